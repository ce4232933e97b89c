"""Captures and edits under compute policies (issue 36 item 4): captures stay in sequence coordinates — at the
positions a call computed they equal the plain forward's captures on the same canvas where the method claims
equality (a full call: every site; a subset call: layer 0's sites before attention, and layer 0's output where
its keys and values are fresh: dKV-Cache's cached layer-0 keys are those of unchanged tokens, dLLM-Cache
recomputes layer 0 whole), and hold zeros exactly where the layer computed nothing; `attn.hook_pattern` reads
only the keys and key blocks the policy kept; an edit acts at every computed position (an embedding edit equals
the same run on weights with the edit folded in); `computed_queries` is the span of `computed_positions`."""

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument.hook_call import HookCall, hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks
from dlm_jax.model import CallInstruments, forward, init_params
from dlm_jax.policy.registry import parse_policy
from dlm_jax.sampling import llada
from dlm_jax.sampling.run_setup import RunSetup

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
OPTIONS = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4)
PATTERN_QUERIES = (8, 11)
HOOKS = Hooks(captures=(Capture("blocks.0.attn.hook_v"), Capture("blocks.0.hook_resid_post"),
                        Capture("blocks.1.hook_resid_post"), Capture("blocks.1.attn.hook_z"),
                        Capture("blocks.1.attn.hook_pattern", positions=PATTERN_QUERIES)),
              edits=(Edit("hook_embed", op="add"),))
"""One static hook set for every run (the edit's coefficient is traced: 0 leaves the run unedited)."""
SPARSED_BLOCK = 2
SPARSE_DLLM = "sparse_dllm:tie_break=lowest_position"
POLICIES = {"dkv_cache": "dkv_cache:query_buckets=2", "sparse_dllm": SPARSE_DLLM,
            "sparsed": f"sparsed:block_size={SPARSED_BLOCK}", "elastic_cache": "elastic_cache:gamma=0.999",
            "dllm_cache": "dllm_cache", "d2cache": "d2cache:query_buckets=2", "sparse_dllm_dual": SPARSE_DLLM}
"""The policies run with hooks (SparseD with key blocks small enough for the 14 positions to have several;
Elastic-Cache with a drift threshold its layer 1 crosses, so that its calls refresh from there; dKV-Cache's and
d2Cache's subset calls run at query buckets smaller than the sequence; Sparse-dLLM also with the dual cache,
`CACHED`). Two buckets rather than the default four, and Sparse-dLLM's lowest-position tie break rather than the
torch_cpu selection, compile about a quarter fewer kernels; the captures do not depend on either (BUILD.md, "What
the policy tests cost")."""
CACHED = {"sparse_dllm_dual": "dual"}


@pytest.fixture(scope="module")
def setup():
  """Weights, two prompts [2, 6] (`jax.random.randint(jax.random.key(1), (2, 6), 0, 200)` written out) and the edit's
  vector [D], both from NumPy: no random-number program to compile."""
  params = init_params(CONFIG, jax.random.key(0))
  prompt = np.array([[196, 127, 40, 153, 168, 84], [38, 181, 106, 146, 8, 33]], np.int32)
  vector = (0.5 * np.random.default_rng(2).standard_normal(CONFIG.d_model)).astype(np.float32)
  return params, prompt, vector


def _run(setup, policy: str, coefficient: float, params=None):
  base, prompt, vector = setup
  values = hook_values(HOOKS, CONFIG, prompt.shape[0], prompt.shape[1] + OPTIONS.gen_length,
                       edits={0: dict(vector=vector, coefficient=coefficient)})
  options = dataclasses.replace(OPTIONS, cache=CACHED.get(policy, "none"))
  return llada.generate(base if params is None else params, prompt, config=CONFIG, options=options,
                        setup=RunSetup(hooks=HOOKS, hook_values=values, policy=parse_policy(POLICIES[policy])))


@pytest.fixture(scope="module")
def runs(setup):
  return {name: _run(setup, name, 0.0) for name in POLICIES}


@pytest.fixture(scope="module")
def plain(setup):
  """The plain forward with the same hooks (unedited) on a canvas [B, S]: its captures by name."""
  params, prompt, vector = setup
  values = hook_values(HOOKS, CONFIG, prompt.shape[0], prompt.shape[1] + OPTIONS.gen_length,
                       edits={0: dict(vector=vector, coefficient=0.0)})
  run = jax.jit(lambda tokens: forward(params, tokens, config=CONFIG,
                                       instruments=CallInstruments(hooks=HookCall(hooks=HOOKS, values=values)))
                .captures)
  return lambda canvas: jax.tree.map(np.asarray, run(jnp.asarray(canvas)))


def _canvas(trace, prompt, step: int) -> np.ndarray:
  """[B, S] the sequence call `step` read: the prompt, the tokens decoded before it, masks elsewhere (LLaDA's
  low-confidence remasking at temperature 0 never re-masks)."""
  generated = np.where(np.asarray(trace.decode_step) < step, np.asarray(trace.generated), CONFIG.mask_token_id)
  return np.concatenate([np.asarray(prompt), generated], axis=1)


def _steps(trace) -> range:
  return range(int(trace.nfe))


def _computed_at_layer(trace, step: int, layer: int, inside: bool) -> np.ndarray:
  """[B, S] the positions the call of `step` computed at `layer` (inside: at the sites inside attention and
  the feed-forward): its computed positions; under a layer refresh every position of a row from its refresh
  start on; under per-layer reuse (a [B, L, S] bool record) the layer's recomputed positions inside."""
  rows = np.asarray(trace.computed_positions)[step]
  record = trace.policy_record
  if isinstance(record, dict) and "refresh_start" in record:
    rows = rows | (np.asarray(record["refresh_start"])[step] <= layer)[:, None]
  if inside and getattr(record, "dtype", None) == bool:
    rows = np.asarray(record)[step][:, layer]
  return rows


def _full_call(trace, step: int) -> bool:
  """The call of `step` computed every position at every layer over every key."""
  s = np.asarray(trace.computed_positions).shape[-1]
  return all(bool(np.all(_computed_at_layer(trace, step, layer, True))) for layer in range(CONFIG.n_layers)) and \
      bool(np.all(np.asarray(trace.keys_read)[step] == s))


@pytest.mark.parametrize("name", list(POLICIES))
def test_captures_hold_the_computed_positions_activations_and_zeros_elsewhere(setup, runs, plain, name):
  _, prompt, _ = setup
  trace = runs[name]
  computed = np.asarray(trace.computed_positions)
  captures = jax.tree.map(np.asarray, trace.captures)
  subset_steps = 0
  for step in _steps(trace):
    reference = plain(_canvas(trace, prompt, step))
    rows = computed[step]
    full = _full_call(trace, step)
    subset_steps += not full
    names = list(reference) if full else ["blocks.0.attn.hook_v"] + (["blocks.0.hook_resid_post"]
                                                                      if name in ("dkv_cache", "dllm_cache") else [])
    for site in names:
      got, want = captures[site][step], reference[site]
      if site.endswith("hook_pattern"):
        continue
      np.testing.assert_allclose(got[rows], want[rows], atol=2e-5, err_msg=f"{name} step {step} {site}")
    for site, layer, inside in (("blocks.0.attn.hook_v", 0, True), ("blocks.1.hook_resid_post", 1, False),
                                ("blocks.1.attn.hook_z", 1, True)):
      at_layer = _computed_at_layer(trace, step, layer, inside)
      assert not np.any(captures[site][step][~at_layer]), (name, step, site)
      values = captures[site][step][at_layer]
      assert np.all(np.any(values.reshape(values.shape[0], -1) != 0, axis=-1)), (name, step, site)
    if full:
      np.testing.assert_allclose(captures["blocks.1.attn.hook_pattern"][step],
                                 reference["blocks.1.attn.hook_pattern"], atol=2e-5)
  assert subset_steps > 0


def test_a_key_subset_patterns_read_only_the_kept_keys(runs):
  trace = runs["sparse_dllm"]
  computed = np.asarray(trace.computed_positions)
  kept = np.asarray(trace.policy_record)  # [steps, B, L, n]: the kept keys after each call
  pattern = np.asarray(trace.captures["blocks.1.attn.hook_pattern"])  # [steps, B, P, N, S]
  s = computed.shape[-1]
  checked = 0
  for step in _steps(trace):
    if np.all(computed[step]) or step == 0:
      continue
    for b in range(pattern.shape[1]):
      read = set(kept[step - 1, b, 1][kept[step - 1, b, 1] < s]) | set(np.flatnonzero(computed[step, b]))
      for p, query in enumerate(PATTERN_QUERIES):
        rows = pattern[step, b, p]  # [N, S]
        if not computed[step, b, query]:
          assert not np.any(rows)
          continue
        checked += 1
        np.testing.assert_allclose(rows.sum(-1), 1.0, atol=1e-5)
        assert not np.any(rows[:, sorted(set(range(s)) - read)])
  assert checked > 0


def test_block_sparse_patterns_read_only_the_kept_blocks(runs):
  trace = runs["sparsed"]
  blocks = np.asarray(trace.policy_record)  # [steps, B, L, N, nQb, m] kept key blocks after each call
  pattern = np.asarray(trace.captures["blocks.1.attn.hook_pattern"])
  s = pattern.shape[-1]
  n_blocks = -(-s // SPARSED_BLOCK)
  checked = 0
  for step in _steps(trace):
    rows_all = pattern[step]
    np.testing.assert_allclose(rows_all.sum(-1), 1.0, atol=1e-5)
    kept_before = blocks[step - 1] if step else None
    if kept_before is None or np.all(kept_before >= n_blocks):
      continue
    for b in range(pattern.shape[1]):
      for p, query in enumerate(PATTERN_QUERIES):
        for n in range(pattern.shape[3]):
          chosen = kept_before[b, 1, n, query // SPARSED_BLOCK]
          allowed = np.zeros(s, bool)
          for block in chosen[chosen < n_blocks]:
            allowed[block * SPARSED_BLOCK:(block + 1) * SPARSED_BLOCK] = True
          if allowed.all():
            continue
          checked += 1
          assert not np.any(pattern[step, b, p, n][~allowed]), (step, b, query, n)
  assert checked > 0


def test_bucketed_subset_calls_ran_at_a_bucket_smaller_than_the_sequence(runs):
  for name in ("dkv_cache", "d2cache"):
    trace = runs[name]
    rows = np.asarray(trace.policy_record["rows"])[:int(trace.nfe)]  # [steps, B]: the rows each call ran
    assert np.any(rows < np.asarray(trace.computed_positions).shape[-1]), name


def test_elastic_cache_refreshed_from_layer_one(runs):
  start = np.asarray(runs["elastic_cache"].policy_record["refresh_start"])
  assert np.any(start[1:int(runs["elastic_cache"].nfe)] == 1)


@pytest.mark.parametrize("name", ["dkv_cache", "elastic_cache", "dllm_cache"])
def test_an_edit_acts_at_every_computed_position(setup, runs, name):
  """An "add" edit of v at hook_embed at every position and step gives the run on weights whose embedding table
  has v added: at a subset call the computed positions are edited and the cached ones were edited when
  computed; a layer refresh recomputes the other positions with the edit."""
  params, _, vector = setup
  edited = _run(setup, name, 1.0)
  folded = dict(params, embed={"embedding": params["embed"]["embedding"] + vector[None].astype(
      params["embed"]["embedding"].dtype)})
  reference = _run(setup, name, 0.0, params=folded)
  np.testing.assert_array_equal(edited.tokens, reference.tokens)
  np.testing.assert_array_equal(edited.decode_step, reference.decode_step)
  for site in ("blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern"):
    np.testing.assert_allclose(edited.captures[site], reference.captures[site], atol=3e-5)
  unedited = runs[name]
  assert not np.allclose(edited.captures["blocks.1.hook_resid_post"], unedited.captures["blocks.1.hook_resid_post"])


def test_computed_queries_is_the_span_of_the_computed_positions(runs):
  for trace in runs.values():
    computed = np.asarray(trace.computed_positions)
    spans = np.asarray(trace.computed_queries)
    for step in _steps(trace):
      where = np.flatnonzero(np.any(computed[step], axis=0))
      np.testing.assert_array_equal(spans[step], [where[0], where[-1] + 1])


def test_dkv_cache_computes_the_positions_masked_at_the_previous_call(setup, runs):
  _, prompt, _ = setup
  trace = runs["dkv_cache"]
  computed = np.asarray(trace.computed_positions)
  for step in _steps(trace):
    if np.all(computed[step]):
      continue
    masked_before = _canvas(trace, prompt, step - 1) == CONFIG.mask_token_id
    np.testing.assert_array_equal(computed[step], masked_before)
