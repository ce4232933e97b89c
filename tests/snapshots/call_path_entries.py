"""Every dlm_jax call of the call-path snapshot (`call_path_snapshot.py`): loading the models, building the
statistics, interventions and hooks a case names, and running it through the library's public entry
points, returning its arrays by name.

Only public entry points are called, the ones the guides and the binaries use:
  models        dlm_jax.io.checkpoint.load, dlm_jax.default_models.path, dlm_jax.config.preset,
                dlm_jax.model.init_params / flatten_params / unflatten_params
  samplers      dlm_jax.sampling.registry.get(name) -> Sampler: .options(CommonSettings(...), **own),
                .generate(params, prompt, *, config, options, key, prompt_mask, setup=RunSetup(stats_spec,
                sink_top_k, intervention, intervention_state, record_intervention, batch_invariant, hooks,
                hook_values)) -> Trace (the call `experiments.generate` and `experiments.common.decoding` make)
  plain calls   dlm_jax.model.forward(params, tokens, *, config, instruments=CallInstruments(stats_spec,
                query_weights));
                dlm_jax.sampling.call_plan.intervened_forward(params, tokens, intervention, state, *,
                config, step, stats_spec, hooks=HookCall(hooks=..., values=...))
  specs         dlm_jax.instrument.stats.StatsSpec; interventions MaskPreviousSinks(AR), MaskKeys, SinkToken,
                Compose (+ init_state, MaskKeys.with_positions); hook_spec Capture / Edit / Hooks / Steps;
                hook_call hook_values / CaptureValues / HookCall; step_schedule StepSchedule / Gate /
                CoefficientSchedule; sampling.decoding_rules.rule_from_name; sampling.corpus_prior
                count / from_document

When a refactor changes one of these signatures, this module is the one place to adapt (the case table and
the snapshot files stay as they are); the arrays a case returns are read from the documented fields of
`Trace` and `ForwardOutput`, not from their pytree layout.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax import default_models, model
from dlm_jax.config import preset
from dlm_jax.instrument import interventions as iv
from dlm_jax.sampling import call_plan
from dlm_jax.instrument.hook_call import CaptureValues, HookCall, hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks, Steps
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.instrument.step_schedule import CoefficientSchedule, Gate, StepSchedule
from dlm_jax.io import checkpoint
from dlm_jax.sampling import corpus_prior, decoding_rules, registry
from dlm_jax.sampling.run_setup import RunSetup

from call_path_cases import Case

SEED = 7
"""The PRNG seed of every sampler run (key(SEED), or fold_in(key(SEED), row) per row)."""

TRACE_FIELDS = ("tokens", "decode_step", "nfe", "active_rows", "computed_queries", "stats", "top_sinks",
                "intervention_record", "accepted", "canvases", "first_nonfinite_step", "captures", "capture_steps",
                "committed", "revoked")
"""The documented `Trace` fields a sampler case records (None fields are absent)."""

FORWARD_STATISTICS = ("incoming_attention", "value_norms", "routed_experts", "routing_weights")
"""The documented `ForwardOutput` statistics a plain call records, besides logits and captures."""

EMBEDDED_PROMPT = np.array([
    [0, 0, 0, 0, 0, 0, 1, 63, 76, 13, 65, 51, 56, 69, 11, 83, 51, 56, 69, 9, 67, 84, 10, 65, 51, 56, 80, 8, 51, 57,
     81, 65, 72, 63, 77, 53],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 54, 76, 22, 68, 51, 62, 74, 10, 83, 51, 57, 81, 68, 72,
     54, 77, 53]], np.int32)
"""Two questions of the embedded models' training layout (36 positions, left-padded with their pad id 0)."""


# ------------------------------------------------------------------------------------------ inputs


def random_params(name: str) -> dict[str, np.ndarray]:
  """A preset's random weights, flat by tensor name (float32, key 0)."""
  params = model.init_params(preset(name), jax.random.key(0), jnp.float32)
  return {k: np.asarray(v) for k, v in model.flatten_params(params).items()}


def load_model(name: str, frozen: dict[str, dict[str, np.ndarray]]) -> tuple[Any, Any]:
  """(config, params) of an embedded checkpoint (float32), or of a preset with the random weights `frozen`
  holds for it (the snapshot's "init" case; fresh ones when it holds none)."""
  if name in default_models.NAMES:
    return checkpoint.load(default_models.path(name), dtype=jnp.float32)
  flat = frozen.get(name) or random_params(name)
  return preset(name), model.unflatten_params({k: jnp.asarray(v) for k, v in flat.items()})


def prompt(case: Case, config) -> tuple[np.ndarray, np.ndarray | None]:
  """[B=2, Lp] prompt ids and the prompt mask (None for a "plain" case)."""
  if case.model in default_models.NAMES:
    ids = EMBEDDED_PROMPT
    return ids, (ids != config.pad_token_id if case.prompt == "padded" else None)
  ids = np.random.default_rng(0).integers(3, 200, (2, 6)).astype(np.int32)
  if case.prompt != "padded":
    return ids, None
  ids[1, :2] = config.pad_token_id
  return ids, ids != config.pad_token_id


def sampler_key(case: Case, batch: int) -> jax.Array:
  """key(SEED), or one key per row."""
  if case.key == "rows":
    return jax.vmap(lambda row: jax.random.fold_in(jax.random.key(SEED), row))(jnp.arange(batch))
  return jax.random.key(SEED)


def _pc_prior(config):
  """PC-Sampler's corpus prior from a fixed Zipf-distributed corpus of token ids."""
  vocab = {f"t{i}": i for i in range(config.vocab_size)}
  corpus = [np.random.default_rng(5).zipf(1.3, size=40) % config.vocab_size for _ in range(4)]
  return corpus_prior.from_document(corpus_prior.count(corpus, vocab))


def own_fields(case: Case, config) -> dict[str, Any]:
  """The case's own option fields, with a named decoding rule built (PC-Sampler with a fixed corpus prior)."""
  own = dict(case.own)
  if "rule" in own:
    rule = own["rule"]
    own["rule"] = decoding_rules.rule_from_name(rule, **({"prior": _pc_prior(config)} if rule == "pc" else {}))
  return own


# ------------------------------------------------------------------------------------------ statistics


def _last(config) -> int:
  return config.n_layers - 1


STATS: dict[str, Callable[[Any], StatsSpec]] = {
    "full": lambda c: StatsSpec(incoming_attention=True, per_head=True, query_groups=3, value_norms=True),
    "full_ungrouped": lambda c: StatsSpec(incoming_attention=True, per_head=True, value_norms=True),
    "head_mean_layers": lambda c: StatsSpec(incoming_attention=True, per_head=False, layers=(_last(c), 0)),
    "groups": lambda c: StatsSpec(incoming_attention=True, per_head=True, query_groups=3),
    "routing": lambda c: StatsSpec(incoming_attention=True, value_norms=True, routing=True),
    "routing_no_norms": lambda c: StatsSpec(incoming_attention=True, query_groups=3, routing=True),
    "forward_groups": lambda c: StatsSpec(incoming_attention=True, per_head=True, query_groups=2, value_norms=True,
                                          layers=(_last(c), 1)),
}
"""Statistics by name: per head with the samplers' three query groups and value norms, head-averaged over a
layer subset, routing on a mixture of experts (no value norms on a layer-pattern model)."""


# ------------------------------------------------------------------------------------------ interventions


def _masked_keys(config, batch: int, seq_len: int) -> jax.Array:
  """[B, S] bool: keys 2 and 5 of row 0 and key 3 of row 1."""
  state = iv.MaskKeys().init_state(config, batch, seq_len)
  return iv.MaskKeys.with_positions(state, jnp.array([[2, 5], [3, -1]], jnp.int32)[:batch])


def intervention(name: str, sampler: str, config, batch: int, seq_len: int) -> tuple[Any, Any]:
  """(intervention, its initial state or None for the default)."""
  if name == "mask_sinks":
    return (iv.MaskPreviousSinksAR(top_k=1) if sampler == "ar" else iv.MaskPreviousSinks(top_k=1)), None
  if name == "sink_token_compose":
    return iv.Compose((iv.SinkToken("front"), iv.MaskPreviousSinks(top_k=1))), None
  if name == "mask_keys":
    return iv.MaskKeys(), _masked_keys(config, batch, seq_len)
  if name == "mask_keys_compose":
    composed = iv.Compose((iv.MaskKeys(), iv.MaskPreviousSinks(top_k=2, per_head=False)))
    state = composed.init_state(config, batch, seq_len)
    return composed, (_masked_keys(config, batch, seq_len), state[1])
  raise ValueError(f"unknown intervention {name!r}")


# ------------------------------------------------------------------------------------------ hooks


def _vector(size: int, seed: int) -> np.ndarray:
  return (0.5 * np.random.default_rng(seed).standard_normal(size)).astype(np.float32)


def hooks(name: str, config, batch: int, seq_len: int, prompt_length: int) -> tuple[Hooks, Any]:
  """(Hooks, their HookValues) for [B, S] sequences."""
  last = _last(config)
  if name == "capture":
    spec = Hooks(captures=(
        Capture("hook_resid_post", layers=(0, last)),
        Capture("attn.hook_pattern", layers=(0,), positions=(prompt_length - 1, prompt_length + 1)),
        Capture("hook_resid_post", layers=(last,), reduce="mean", positions="masked", steps=Steps.every(2),
                label="resid_mean_masked"),
        Capture("ln_final.hook_normalized", steps=Steps.decoded())))
    return spec, hook_values(spec, config, batch, seq_len)
  if name in ("edit", "forward_hooks"):
    spec = Hooks(
        captures=(Capture("hook_resid_post", layers=(last,)),
                  Capture("attn.hook_pattern", layers=(last,), positions=(prompt_length - 1,))),
        edits=(Edit("hook_resid_post", "add", layers=(0,), positions="all"),
               Edit("attn.hook_z", "zero", layers=(last,)),
               Edit("hook_mlp_out", "scale", layers=(0,), positions="masked")))
    heads = np.zeros((batch, config.n_heads), bool)
    heads[:, 1] = True
    heads[-1, 0] = True
    window = (0, 1) if name == "forward_hooks" else (1, 6)
    return spec, hook_values(spec, config, batch, seq_len, edits={
        0: dict(vector=_vector(config.d_model, 3), coefficient=np.array([2.0, -1.0], np.float32)[:batch],
                window=window),
        1: dict(heads=heads),
        2: dict(coefficient=0.5)})
  if name == "patch":
    spec = Hooks(captures=(Capture("hook_resid_post", layers=(last,), reduce="norm"),),
                 edits=(Edit("hook_resid_pre", "replace", layers=(1,), source="values"),
                        Edit("hook_attn_out", "mean", layers=(0,), positions="masked")))
    steps = np.array([0, 2, 4, 6], np.int32)
    values = 0.5 * np.random.default_rng(8).standard_normal((len(steps), 1, batch, seq_len, config.d_model))
    return spec, hook_values(spec, config, batch, seq_len, edits={
        0: dict(values=values.astype(np.float32), value_steps=steps, window=(0, 5))})
  if name == "step_schedule":
    spec = Hooks(captures=(Capture("hook_resid_post", layers=0, reduce="project", label="probe"),
                           Capture("hook_resid_post", layers=(1,), positions="masked", reduce="norm")),
                 edits=(Edit("hook_resid_post", "add", layers=1, positions="masked",
                             schedule=StepSchedule(n_steps=8, n_bins=2, gate=Gate("probe.0"))),))
    direction = _vector(config.d_model, 4)
    return spec, hook_values(spec, config, batch, seq_len,
                             captures={0: CaptureValues(directions=(direction / np.linalg.norm(direction))[None])},
                             edits={0: dict(vector=np.stack([_vector(config.d_model, 5), _vector(config.d_model, 6)]),
                                            coefficient=4.0,
                                            schedule=dict(table=CoefficientSchedule("window", 1.0, start=2,
                                                                                    stop=6).table(8),
                                                          bins=[0, 0, 0, 0, 1, 1, 1, 1], gate_scale=1.0,
                                                          gate_bias=0.0))})
  if name == "router_logits":
    spec = Hooks(captures=(Capture("mlp.hook_router_logits"),
                           Capture("hook_mlp_out", layers=(1,), reduce="norm", positions="masked")))
    return spec, hook_values(spec, config, batch, seq_len)
  raise ValueError(f"unknown hooks {name!r}")


# ------------------------------------------------------------------------------------------ runs


def _arrays(prefix: str, tree: Any) -> dict[str, np.ndarray]:
  """The leaves of `tree` by path ("prefix/key/index..."), as host arrays."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    parts = [prefix] + [str(getattr(p, "name", getattr(p, "key", getattr(p, "idx", p)))) for p in path]
    value = jax.random.key_data(leaf) if jnp.issubdtype(getattr(leaf, "dtype", np.float32),
                                                           jax.dtypes.prng_key) else leaf
    out["/".join(parts)] = np.asarray(value)
  return out


def _sequence_length(sampler: registry.Sampler, options: Any, prompt_length: int, common: dict) -> int:
  """The sampler's sequence length: prompt + generation, on whole blocks for block diffusion (its guide)."""
  total = prompt_length + common["gen_length"]
  if sampler.blocks == "attention":
    return math.ceil(total / options.block_length) * options.block_length
  return total


def run_sampler(case: Case, config, params) -> dict[str, np.ndarray]:
  """One sampler run through the registry; the Trace's documented fields by name."""
  sampler = registry.get(case.entry)
  ids, mask = prompt(case, config)
  options = sampler.options(registry.CommonSettings(**case.common), **own_fields(case, config))
  batch, length = ids.shape[0], _sequence_length(sampler, options, ids.shape[1], case.common)
  kwargs: dict[str, Any] = {}
  if case.stats:
    kwargs["stats_spec"] = STATS[case.stats](config)
  if case.sink_top_k:
    kwargs["sink_top_k"] = case.sink_top_k
  if case.intervention:
    made, state = intervention(case.intervention, case.entry, config, batch, length)
    kwargs.update(intervention=made, record_intervention=True)
    if state is not None:
      kwargs["intervention_state"] = state
  if case.hooks:
    spec, values = hooks(case.hooks, config, batch, length, ids.shape[1])
    kwargs.update(hooks=spec, hook_values=values)
  if case.batch_invariant:
    kwargs["batch_invariant"] = True
  trace = sampler.generate(params, jnp.asarray(ids), config=config, options=options, key=sampler_key(case, batch),
                           prompt_mask=None if mask is None else jnp.asarray(mask), setup=RunSetup(**kwargs))
  out = {}
  for field in TRACE_FIELDS:
    out.update(_arrays(field, getattr(trace, field, None)))
  return out


def _forward_arrays(prefix: str, output) -> dict[str, np.ndarray]:
  out = _arrays(f"{prefix}logits", output.logits)
  for name in FORWARD_STATISTICS:
    out.update(_arrays(f"{prefix}{name}", getattr(output, name)))
  out.update(_arrays(f"{prefix}captures", dict(output.captures or {})))
  return out


def _forward_tokens(config) -> np.ndarray:
  """[2, 52] the embedded prompt followed by 16 masks."""
  return np.concatenate([EMBEDDED_PROMPT, np.full((2, 16), config.mask_token_id, np.int32)], axis=1)


def run_forward(case: Case, config, params) -> dict[str, np.ndarray]:
  """One plain `model.forward` call over a prompt and its masks: logits and statistics (query groups masked /
  the rest when the spec has two)."""
  tokens = _forward_tokens(config)
  spec = STATS[case.stats](config)
  weights = None
  if spec.query_groups:
    is_mask = tokens == config.mask_token_id
    weights = jnp.asarray(np.stack([is_mask, ~is_mask], axis=1).astype(np.float32))
  output = model.forward(params, jnp.asarray(tokens), config=config,
                         instruments=model.CallInstruments(stats_spec=spec, query_weights=weights))
  return _forward_arrays("", output)


def run_intervened_forward(case: Case, config, params) -> dict[str, np.ndarray]:
  """Two chained `intervened_forward` calls (steps 0 and 1, the state carried), with the case's hooks:
  both outputs and the final state."""
  tokens = jnp.asarray(_forward_tokens(config))
  batch, length = tokens.shape
  made, state = intervention(case.intervention, "forward", config, batch, length)
  kwargs: dict[str, Any] = {}
  if case.stats:
    kwargs["stats_spec"] = STATS[case.stats](config)
  if case.hooks:
    spec, values = hooks(case.hooks, config, batch, length, EMBEDDED_PROMPT.shape[1])
    kwargs["hooks"] = HookCall(hooks=spec, values=values)
  out = {}
  for step in (0, 1):
    output, state = call_plan.intervened_forward(params, tokens, made, state, config=config, step=step, **kwargs)
    out.update(_forward_arrays(f"call{step}/", output))
  out.update(_arrays("state", state))
  return out


def run(case: Case, config, params) -> dict[str, np.ndarray]:
  """The case's arrays by name."""
  if case.entry == "forward":
    return run_forward(case, config, params)
  if case.entry == "intervened_forward":
    return run_intervened_forward(case, config, params)
  return run_sampler(case, config, params)
