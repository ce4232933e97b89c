"""Exact batch independence (`batch_invariant=True`, `dlm_jax.sampling.row_by_row`): an item's tokens, decode
order, statistics, top sinks and sink-masker record are bitwise the same at batch sizes 1, 3, 5, 8 and 16,
whatever its neighbours and its row, on the embedded tiny-dlm with left-padded prompts of different lengths
(the batch-invariant padding layout), the per-step sink masker of sink_masking_eval and per-row keys."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax import default_models
from dlm_jax.instrument import interventions
from dlm_jax.io import checkpoint
from dlm_jax.sampling import llada
from dlm_jax.instrument.stats import StatsSpec

WIDTH, N_ITEMS = 10, 16
OPTIONS = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4, padding="key", shift_positions=True)
SPEC = StatsSpec(incoming_attention=True, per_head=True, value_norms=True)
MASKER = interventions.MaskPreviousSinks(top_k=1)
TARGETS = (0, 5, 11)


@functools.lru_cache(maxsize=1)
def _model():
  return checkpoint.load(default_models.path("tiny-dlm"))


def _prompts():
  """N_ITEMS prompts of 3..WIDTH tokens (BOS, then ids of the synthetic vocabulary)."""
  rng = np.random.default_rng(7)
  return [[1] + list(rng.integers(4, 90, int(rng.integers(2, WIDTH)))) for _ in range(N_ITEMS)]


def _run(rows: list[int], batch_invariant: bool):
  """The items `rows` as one left-padded batch: {item: its row's results as numpy arrays}."""
  config, params = _model()
  prompts = _prompts()
  ids = np.zeros((len(rows), WIDTH), np.int32)
  mask = np.zeros((len(rows), WIDTH), bool)
  for r, item in enumerate(rows):
    ids[r, WIDTH - len(prompts[item]):] = prompts[item]
    mask[r, WIDTH - len(prompts[item]):] = True
  total = WIDTH + OPTIONS.gen_length
  state = MASKER.init_state(config, len(rows), total).replace(
      eligible=jnp.asarray(np.concatenate([mask, np.ones((len(rows), OPTIONS.gen_length), bool)], 1)))
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.asarray(rows))
  trace = llada.generate(params, ids, config=config, options=OPTIONS, key=keys, prompt_mask=mask, stats_spec=SPEC,
                         intervention=MASKER, intervention_state=state, sink_top_k=2, record_intervention=True,
                         batch_invariant=batch_invariant)
  trace = jax.device_get(trace)
  out = {}
  for r, item in enumerate(rows):
    out.setdefault(item, {
        "tokens": trace.tokens[r], "decode_step": trace.decode_step[r],
        "incoming": trace.stats["incoming_attention"][:, :, r], "value_norms": trace.stats["value_norms"][:, :, r],
        "top_sinks": trace.top_sinks[:, :, r], "masked": trace.intervention_record[:, :, r]})
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


def _results(batch: int, batch_invariant: bool) -> dict[int, list[dict]]:
  results: dict[int, list[dict]] = {}
  for rows in _layouts(batch):
    for item, values in _run(rows, batch_invariant).items():
      if item in TARGETS:
        results.setdefault(item, []).append(values)
  return results


@pytest.fixture(scope="module")
def reference():
  return _results(1, True)


@pytest.mark.parametrize("batch", [3, 5, 8, 16])
def test_item_results_are_bitwise_independent_of_the_batch(reference, batch):
  results = _results(batch, True)
  assert set(results) == set(TARGETS)
  for item in TARGETS:
    for values in results[item]:
      for name, array in reference[item][0].items():
        np.testing.assert_array_equal(values[name], array, err_msg=f"item {item}, {name}, batch {batch}")


def test_the_masker_and_statistics_are_exercised(reference):
  """The comparison is not vacuous: the masker masked keys, statistics are non-trivial, rows differ."""
  first = reference[TARGETS[0]][0]
  assert first["masked"][1:].any() and np.ptp(first["incoming"]) > 0
  assert not np.array_equal(reference[TARGETS[0]][0]["tokens"], reference[TARGETS[1]][0]["tokens"])
