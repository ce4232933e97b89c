"""Query groups and interventions on the DiffusionGemma sampler, which has no mask token.

Query groups: a decoder step's "masked" queries are the canvas positions not holding the token the previous
step accepted, its "unmasked" ones the accepted positions; the encoder's prompt queries are "prompt" and a
re-encoded canvas's queries "unmasked". They are checked against per-query attention rows of the same
calls, replayed outside the sampler (dense attention, the sampler's random draws injected), summed in NumPy.
Sink masking: each call masks the top-K sinks of the row's previous call, whatever its kind (encoder commit
or decoder step), and the masked keys get zero attention. The extra sink token at the front: its row sees
only itself and global decoder layers attend to it; at the end it is refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.instrument import interventions as iv
from dlm_jax import model
from dlm_jax.config import preset
from dlm_jax.sampling import diffusion_gemma as dg
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-diffusiongemma")
K_SINKS = 2
B, LP = 3, 4  # LP = C: one compiled reference for every encoder call
# adaptive stopping at a loose confidence bound: rows finish a canvas at different steps and wait
OPTIONS = dg.DiffusionGemmaOptions(gen_length=8, canvas_length=4, max_denoising_steps=4, stability_threshold=0,
                                   confidence_threshold=0.3, eos_stop=False)
KEY = jax.random.key(7)
_forward = jax.jit(model.forward, static_argnames=("config", "stats_spec", "attention_impl"))


@pytest.fixture(scope="module")
def params():
  """Random tiny weights with peaked logits (embedding rows N(0, 1)·50, argmax decisions far from ties, so a
  replay outside the sampler takes the same decisions) and a contractive self-conditioning."""
  p = jax.jit(model.init_params, static_argnums=0)(CONFIG, jax.random.key(3))
  p["self_conditioning"]["mlp"]["down"]["kernel"] = 0.1 * p["self_conditioning"]["mlp"]["down"]["kernel"]
  p["embed"]["embedding"] = 50.0 * p["embed"]["embedding"]
  return p


def _prompt() -> np.ndarray:
  return np.random.default_rng(0).integers(3, CONFIG.vocab_size, (B, LP))


@pytest.fixture(scope="module")
def masked_run(params):
  """One sampler run with sink masking (top-2 per layer and head), the three query groups and the record:
  (trace, incoming [calls, L, B, 3, N, S] float64, record [calls, L, B, N, S] bool)."""
  trace = dg.generate(params, _prompt(), config=CONFIG, options=OPTIONS, key=KEY,
                      setup=RunSetup(intervention=iv.MaskPreviousSinks(top_k=K_SINKS), record_intervention=True,
                                     stats_spec=StatsSpec(incoming_attention=True, per_head=True, query_groups=3)))
  n = int(trace.nfe)
  incoming = np.asarray(trace.stats["incoming_attention"], np.float64)[:n]
  return trace, incoming, np.asarray(trace.intervention_record)[:n]


def _per_query_rows(params, tokens, cache, offset, bias, decoder=False, sc=None, sc_mask=None):
  """Attention rows [L, B, T, N, S] float64 of one encoder or decoder call (dense attention; one query group
  per query), its logits [B, T, V] and its cache; sc [B, T, V], sc_mask [B]: the self-conditioning input."""
  t = tokens.shape[1]
  spec = StatsSpec(incoming_attention=True, per_head=True, query_groups=t)
  weights = jnp.broadcast_to(jnp.eye(t, dtype=jnp.float32), (tokens.shape[0], t, t))
  out = _forward(params, jnp.asarray(tokens), config=CONFIG, bias=bias, cache=cache, cache_offset=offset,
                 decoder=model.DecoderCall(sc, sc_mask) if decoder else None,
                 query_weights=weights, stats_spec=spec, attention_impl="dense")
  return np.asarray(out.incoming_attention, np.float64), np.asarray(out.logits), out.cache


def _replay_groups(params, trace, record):
  """Replays every call of the run outside the sampler (same inputs: committed canvases from the trace,
  decoder canvases rebuilt from the injected draws and `Trace.accepted`, the recorded masks as biases) and
  returns, per call, the per-query rows [L, B, T, N, S] and the group masks [3, B, T] of the definition."""
  c, v = OPTIONS.canvas_length, CONFIG.vocab_size
  tokens, queries = np.asarray(trace.tokens), np.asarray(trace.computed_queries)
  active, accepted = np.asarray(trace.active_rows), np.asarray(trace.accepted)
  cache = model.KVCache.zeros(CONFIG, B, LP + OPTIONS.gen_length)
  k, out, argmax = -1, [], None
  for i in range(int(trace.nfe)):
    start, stop = queries[i]
    bias = iv.key_mask_bias(jnp.asarray(record[i]), per_layer_head=True)
    none, every = np.zeros((B, stop - start), bool), np.ones((B, stop - start), bool)
    if not active[i].any():  # an encoder call: the prompt, or the finished canvas k
      if argmax is not None:  # the commit of canvas k: the replay's last argmax
        np.testing.assert_array_equal(tokens[:, start:stop], argmax, err_msg=f"replay diverged before call {i}")
      rows, _, cache = _per_query_rows(params, tokens[:, start:stop], cache, start, bias)
      groups = [none, none, every] if start == 0 else [none, every, none]
      k, step = k + 1, 0
      canvas = np.asarray(dg.canvas_draws(KEY, k, (B, c), v, False))
      argmax, held, sc = canvas.copy(), np.zeros((B, c), bool), np.zeros((B, c, v), np.float32)
    else:
      rows, logits, _ = _per_query_rows(params, canvas, cache, start, bias, True, jnp.asarray(sc),
                                        jnp.full((B,), step > 0))
      groups = [~held, held, none]
      z = logits / dg.temperature(OPTIONS, step)
      gumbel, renoise = (np.asarray(a) for a in dg.step_draws(KEY, k, jnp.int32(step), (B, c), v, False))
      on = active[i][:, None]
      canvas = np.where(on, np.where(accepted[i], np.argmax(z + gumbel, -1), renoise), canvas)
      argmax = np.where(on, np.argmax(z, -1), argmax)
      held = np.where(on, accepted[i], held)
      sc = np.where(on[..., None], z, sc)
      step += 1
    out.append((rows, np.stack(groups)))
  return out


def _grouped(rows, groups):
  """[L, B, 3, N, S]: the per-query rows [L, B, T, N, S] summed over each group's queries ([3, B, T])."""
  return np.einsum("lbtns,gbt->lbgns", rows, groups.astype(np.float64))


def test_query_groups_are_the_previous_steps_accepted_positions(params, masked_run):
  trace, incoming, record = masked_run
  active = np.asarray(trace.active_rows)
  assert (active.any(1) & ~active.all(1)).any()  # some decoder step ran with rows waiting (groups kept)
  swapped_gap = 0.0
  for i, (rows, groups) in enumerate(_replay_groups(params, trace, record)):
    start, stop = np.asarray(trace.computed_queries)[i]
    np.testing.assert_allclose(incoming[i], _grouped(rows, groups), atol=2e-5, err_msg=f"call {i}")
    # the groups partition the queries: together they are the ungrouped statistic (each row sums to 1)
    np.testing.assert_allclose(incoming[i].sum(2), rows.sum(2), atol=2e-5)
    np.testing.assert_allclose(incoming[i].sum((2, 4)), stop - start, rtol=1e-5)
    if active[i].any():
      assert not incoming[i, :, :, 2].any()  # no prompt query at a decoder step
      swapped_gap = max(swapped_gap, np.abs(incoming[i] - _grouped(rows, groups[[1, 0, 2]])).max())
    else:
      assert not incoming[i, :, :, 0].any()  # an encoder call has no unresolved query
  assert swapped_gap > 0.1  # the check tells "masked" from "unmasked"


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
  """Brute-force top-k keys of scores [..., S] (ties: the lower position first) as a bool mask."""
  out = np.zeros(scores.shape, bool)
  for index in np.ndindex(*scores.shape[:-1]):
    for j in sorted(range(scores.shape[-1]), key=lambda j: (-scores[index + (j,)], j))[:k]:
      out[index + (j,)] = True
  return out


def test_sink_masking_masks_the_sinks_of_the_rows_previous_call(masked_run):
  """The keys masked at call t are the top-K sinks of call t−1 (encoder or decoder alike, so across a canvas
  boundary too) for the rows that took part in it (every row at an encoder call), and the keys masked at
  t−1 for a row that waited; masked keys get exactly zero attention at call t in their layer and head."""
  trace, incoming, record = masked_run
  active, queries = np.asarray(trace.active_rows), np.asarray(trace.computed_queries)
  encoder = ~active.any(1)
  assert not record[0].any()
  transitions, waited = set(), False
  for t in range(1, len(record)):
    took_part = active[t - 1] | encoder[t - 1]
    expected = np.where(took_part[None, :, None, None], _top_k(incoming[t - 1].sum(2), K_SINKS), record[t - 1])
    np.testing.assert_array_equal(record[t], expected, err_msg=f"call {t}")
    ungrouped = incoming[t].sum(2)
    assert np.all(ungrouped[record[t]] == 0.0), t
    assert record[t][..., :queries[t, 1]].sum(-1).min() >= 1  # keys the call sees are masked everywhere
    transitions.add((bool(encoder[t - 1]), bool(encoder[t])))
    waited |= not took_part.all()
  # a decoder step after a commit, a commit after a decoder step, decoder steps in a row; rows that waited
  assert {(True, False), (False, True), (False, False)} <= transitions and waited


SINK_OPTIONS = dg.DiffusionGemmaOptions(gen_length=4, canvas_length=4, max_denoising_steps=2,
                                        confidence_threshold=None, eos_stop=False)


def test_front_sink_token_sees_itself_and_global_decoder_layers_see_it(params):
  prompt = iv.add_sink_token(jnp.asarray(_prompt(), jnp.int32), sink_token_id=3)  # [B, LP + 1], LP + 1 >= W
  lp, total = prompt.shape[1], prompt.shape[1] + SINK_OPTIONS.gen_length
  sink = iv.SinkToken("front")
  spec = StatsSpec(incoming_attention=True, per_head=True)
  # the second run marks no sink (state is data, so the program is the same): the bias is all zero
  runs = [dg.generate(params, prompt, config=CONFIG, options=SINK_OPTIONS, key=KEY,
                      setup=RunSetup(stats_spec=spec, intervention=sink, intervention_state=state))
          for state in (sink.init_state(CONFIG, B, total), jnp.zeros((B, total), bool))]
  # the encoder call's attention rows under the bias the sampler builds: the sink's row is its own key only
  context = iv.CallContext(step=jnp.int32(0), tokens=runs[0].tokens, query_offset=0, query_length=lp)
  rows, _, _ = _per_query_rows(params, prompt, model.KVCache.zeros(CONFIG, B, total), 0,
                               sink.bias(sink.init_state(CONFIG, B, total), context))
  np.testing.assert_allclose(rows[:, :, 0], np.broadcast_to(np.eye(total)[0], rows[:, :, 0].shape), atol=1e-6)
  incoming = np.asarray(runs[0].stats["incoming_attention"])[1:int(runs[0].nfe)]  # decoder steps [., L, B, N, S]
  kinds = np.array(list(CONFIG.layer_kinds))  # "ssgsg"
  assert incoming[:, kinds == "g", ..., 0].min() > 0.0  # every global head of every decoder step sees the sink
  assert incoming[:, kinds == "g", ..., 0].max() > 0.5
  assert np.all(incoming[:, kinds == "s", ..., 0] == 0.0)  # outside the sliding window of a step at lp >= W
  # under the causal encoder the sink's row sees only itself anyway: the sink bias changes nothing
  np.testing.assert_array_equal(np.asarray(runs[0].tokens), np.asarray(runs[1].tokens))
  np.testing.assert_allclose(np.asarray(runs[0].stats["incoming_attention"]),
                             np.asarray(runs[1].stats["incoming_attention"]), atol=1e-6)


@pytest.mark.parametrize("intervention", [iv.SinkToken("end"), iv.Compose((iv.MaskPreviousSinks(),
                                                                          iv.Compose((iv.SinkToken("end"),))))])
def test_end_sink_token_is_refused(params, intervention):
  with pytest.raises(ValueError, match=r"SinkToken\(position='end'\) cannot run with DiffusionGemma"):
    dg.generate(params, _prompt(), config=CONFIG, options=SINK_OPTIONS, setup=RunSetup(intervention=intervention))
