"""Exact batch independence (`batch_invariant=True`, `dlm_jax.sampling.row_by_row`): an item's tokens, decode
order, statistics, top sinks and sink-masker record are bitwise the same at batch sizes 1, 3, 5, 8 and 16,
whatever its neighbours and its row, with left-padded prompts of different lengths (the batch-invariant
padding layout), the per-step sink masker of sink_masking_eval and per-row keys: the LLaDA sampler on the
embedded tiny-dlm, and DiffusionGemma's (self-conditioned decoder steps over the prompt's KV cache) on the
embedded tiny-uniform-dlm, with adaptive stopping and EOS stops (every row of these prompts stops at EOS within
its first canvas, so no canvas is committed to the encoder here). A batch skips a step only once every row
is done with it, so the step axis of a row's trace holds, besides the row's own steps, the steps it waited
through for its neighbours (`Trace.active_rows` False), which depend on the batch by construction: a row's
results are compared at its own steps, in order (decode_step as the index of the decoding step among
them)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import default_models
from dlm_jax.instrument import interventions
from dlm_jax.io import checkpoint
from dlm_jax.sampling import diffusion_gemma, llada
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.sampling.run_setup import RunSetup

WIDTH, N_ITEMS = 10, 16
MASKER = interventions.MaskPreviousSinks(top_k=1)
TARGETS = (0, 5, 11)
FAMILIES = {
    # name: (embedded model, sampler, options, statistics)
    "llada": ("tiny-dlm", llada.generate,
              llada.LLaDAOptions(gen_length=8, steps=8, block_length=4, padding="key", shift_positions=True),
              StatsSpec(incoming_attention=True, per_head=True, value_norms=True)),
    # layer_pattern models have no value norms; the sampler's query groups instead (masked = renoised). Two
    # canvases: every row of these prompts stops at EOS in the first, so the second is the skipped canvas (each
    # canvas is a copy of the encoder and decoder calls in the compiled program; a third compiled one more).
    "diffusion_gemma": ("tiny-uniform-dlm", diffusion_gemma.generate,
                        diffusion_gemma.DiffusionGemmaOptions(gen_length=8, canvas_length=4, max_denoising_steps=6,
                                                              confidence_threshold=0.5, eos_stop=True),
                        StatsSpec(incoming_attention=True, per_head=True, query_groups=3)),
}


@functools.cache
def _model(name: str):
  return checkpoint.load(default_models.path(name))


def _prompts():
  """N_ITEMS prompts of 3..WIDTH tokens (BOS, then ids of the synthetic vocabulary)."""
  rng = np.random.default_rng(7)
  return [[1] + list(rng.integers(4, 90, int(rng.integers(2, WIDTH)))) for _ in range(N_ITEMS)]


def _run(family: str, rows: list[int], batch_invariant: bool):
  """The items `rows` as one left-padded batch: {item: its row's results as numpy arrays}."""
  model, generate, options, spec = FAMILIES[family]
  config, params = _model(model)
  prompts = _prompts()
  ids = np.zeros((len(rows), WIDTH), np.int32)
  mask = np.zeros((len(rows), WIDTH), bool)
  for r, item in enumerate(rows):
    ids[r, WIDTH - len(prompts[item]):] = prompts[item]
    mask[r, WIDTH - len(prompts[item]):] = True
  total = WIDTH + options.gen_length
  state = MASKER.init_state(config, len(rows), total).replace(
      eligible=jnp.asarray(np.concatenate([mask, np.ones((len(rows), options.gen_length), bool)], 1)))
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.asarray(rows))
  trace = generate(params, ids, config=config, options=options, key=keys, prompt_mask=mask,
                   setup=RunSetup(stats_spec=spec, intervention=MASKER, intervention_state=state, sink_top_k=2,
                                  record_intervention=True, batch_invariant=batch_invariant))
  trace = jax.device_get(trace)
  out = {}
  for r, item in enumerate(rows):
    own = trace.active_rows[:, r]  # the row's own steps (module docstring)
    decode_step = trace.decode_step[r]
    ordinal = np.where(decode_step >= 0, np.cumsum(own)[np.maximum(decode_step, 0)] - 1, -1)
    values = {"tokens": trace.tokens[r], "decode_step": ordinal, "n_steps": own.sum(),
              "top_sinks": trace.top_sinks[own, :, r], "masked": trace.intervention_record[own, :, r]}
    values.update({name: x[own, :, r] for name, x in trace.stats.items()})
    if trace.canvases is not None:
      values.update(canvases=trace.canvases[own, r], accepted=trace.accepted[own, r])
    out.setdefault(item, values)
  return out


def _layouts(batch: int) -> list[list[int]]:
  """Batches of `batch` rows covering every target: at batch 1 each target alone; otherwise (batch >= 3) the
  targets at different rows among other neighbours (two batches, so a target's neighbours change too)."""
  if batch == 1:
    return [[t] for t in TARGETS]
  rng = np.random.default_rng(batch)
  layouts = []
  for _ in range(2):
    others = [i for i in rng.permutation(N_ITEMS) if i not in TARGETS][:batch - len(TARGETS)]
    layouts.append([int(i) for i in rng.permutation(list(others) + list(TARGETS))])
  return layouts


def _results(family: str, batch: int, batch_invariant: bool) -> dict[int, list[dict]]:
  results: dict[int, list[dict]] = {}
  for rows in _layouts(batch):
    for item, values in _run(family, rows, batch_invariant).items():
      if item in TARGETS:
        results.setdefault(item, []).append(values)
  return results


@functools.cache
def _reference(family: str):
  return _results(family, 1, True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("batch", [3, 5, 8, 16])
def test_item_results_are_bitwise_independent_of_the_batch(family, batch):
  reference = _reference(family)
  results = _results(family, batch, True)
  assert set(results) == set(TARGETS)
  for item in TARGETS:
    for values in results[item]:
      assert values.keys() == reference[item][0].keys()
      for name, array in reference[item][0].items():
        np.testing.assert_array_equal(values[name], array, err_msg=f"{family}, item {item}, {name}, batch {batch}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_masker_and_statistics_are_exercised(family):
  """The comparison is not vacuous: the masker masked keys, statistics are non-trivial, rows differ."""
  reference = _reference(family)
  first = reference[TARGETS[0]][0]
  assert first["masked"][1:].any() and np.ptp(first["incoming_attention"]) > 0
  if family == "diffusion_gemma":  # adaptive stopping ends canvases early (the waiting steps are left out)
    assert first["n_steps"] < FAMILIES[family][2].n_canvases * (1 + FAMILIES[family][2].max_denoising_steps)
  assert not np.array_equal(reference[TARGETS[0]][0]["tokens"], reference[TARGETS[1]][0]["tokens"])

