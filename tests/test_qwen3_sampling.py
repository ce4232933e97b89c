"""Generation with the Qwen3-based DLMs, converted from tiny hub-layout checkpoints (tests/qwen3_fixtures.py):
the MDLM variant through the LLaDA-style sampler (every decoding mode), the BD3LM and SDAR variants through
block diffusion with the exact KV cache. Exact decoding is compared token for token with loops written
here on transformers' logits; statistics, sink masking and the sink token run on each variant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from converters.hf_convert import convert
from dlm_jax.io import checkpoint
from dlm_jax.instrument import interventions as iv
from dlm_jax.sampling import block_diffusion, llada
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.session import checkpoint_bundle, decoding_mode

try:
  from tests import qwen3_fixtures as qf
except ImportError:
  import qwen3_fixtures as qf

P, G, SINK_ID = 6, 12, 90
PROMPTS = np.random.default_rng(11).integers(2, 90, size=(2, P))
BLOCKS = {"mdlm": None, "bd3lm": 8, "sdar": 4}  # BD3LM converted with blocks of 8 to keep the canvas short
THRESHOLD = 0.3  # low enough that random tiny models commit several tokens at some steps


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """variant -> (config, params, reference model)."""
  root = tmp_path_factory.mktemp("qwen3_sampling")
  out = {}
  for seed, variant in enumerate(BLOCKS):
    directory, reference = qf.build(variant, str(root / "hf"), seed=seed + 10)
    block = 8 if variant == "bd3lm" else None
    config = convert(directory, str(root / variant), dtype="float32", block_size=block)
    assert config.attention_block_size == BLOCKS[variant]
    out[variant] = (config, checkpoint.load(str(root / variant), dtype=jnp.float32)[1], reference)
  return out


def _probabilities(reference, tokens, mask):
  with torch.no_grad():
    logits = reference(input_ids=torch.as_tensor(tokens[None]), attention_mask=torch.as_tensor(mask)).logits[0]
  return torch.softmax(logits.double(), -1).numpy()


def llada_reference(reference, prompt, steps, block_length):
  """LLaDA's low-confidence remasking at temperature 0, bidirectional: per block, the block's masks split
  evenly over its steps (remainder first); each step commits the most confident masked positions."""
  x = np.concatenate([prompt, np.full(G, qf.MASK_ID)])
  per_block = steps // (G // block_length)
  for start in range(P, P + G, block_length):
    masks = block_length
    quotas = [masks // per_block + (j < masks % per_block) for j in range(per_block)]
    for quota in quotas:
      probs = _probabilities(reference, x, qf.hf_mask(len(x), "bidirectional"))
      x0, p = probs.argmax(-1), probs.max(-1)
      confidence = np.where(x == qf.MASK_ID, p, -np.inf)
      confidence[start + block_length:] = -np.inf
      chosen = np.argsort(-confidence, kind="stable")[:quota]
      x[chosen] = x0[chosen]
  return x


def block_reference(reference, prompt, block, steps, threshold):
  """LLaDA2 / SDAR low_confidence_dynamic at temperature 0 on the block-causal grid: step j of a block has
  the quota of splitting the block length over the steps; every masked position with p > τ is committed if
  that reaches the quota, else the quota's most confident ones."""
  total = -(-(P + G) // block) * block
  x = np.full(total, qf.MASK_ID)
  x[:P] = prompt
  quotas = [block // steps + (j < block % steps) for j in range(steps)]
  for start in range(P // block * block, total, block):
    end = start + block
    for quota in quotas:
      candidates = np.flatnonzero(x[start:end] == qf.MASK_ID) + start
      if not len(candidates):
        break
      probs = _probabilities(reference, x[:end], qf.hf_mask(end, "block", block))
      x0, p = probs.argmax(-1), probs.max(-1)
      above = candidates[p[candidates] > threshold]
      chosen = above if len(above) >= quota else candidates[np.argsort(-p[candidates], kind="stable")[:quota]]
      x[chosen] = x0[chosen]
  return x


def _generate(config, params, options, prompt=PROMPTS, **kwargs):
  sampler = llada.generate if config.attention_block_size is None else block_diffusion.generate
  with jax.default_matmul_precision("highest"):
    return sampler(params, jnp.asarray(prompt), config=config, options=options, **kwargs)


def _block_options(config, threshold):
  return block_diffusion.BlockDiffusionOptions(
      gen_length=G, block_length=config.attention_block_size, steps=config.attention_block_size, threshold=threshold,
      eos_stop=False)


def test_the_binaries_pick_each_variants_sampler(models):
  assert [checkpoint_bundle.default_sampler(models[v][0]) for v in BLOCKS] == ["llada", "block_diffusion",
                                                                          "block_diffusion"]


def test_mdlm_exact_decoding_matches_a_loop_on_transformers(models):
  config, params, reference = models["mdlm"]
  trace = _generate(config, params, llada.LLaDAOptions(gen_length=G, steps=G, block_length=4))
  assert not (np.asarray(trace.generated) == qf.MASK_ID).any()
  for row in range(len(PROMPTS)):
    np.testing.assert_array_equal(np.asarray(trace.tokens[row]), llada_reference(reference, PROMPTS[row], G, 4))


@pytest.mark.parametrize("decoding", ["threshold", "factor", "prefix_cache", "dual_cache"])
def test_mdlm_decodes_in_every_decoding_mode(models, decoding):
  """Each rule and each cache (the threshold + cache modes combine them; tests/test_llada_modes.py)."""
  config, params, _ = models["mdlm"]
  mode = decoding_mode.from_values(decoding)
  options = llada.LLaDAOptions(gen_length=G, steps=G, block_length=4, **mode.option_fields("llada"))
  trace = _generate(config, params, options)
  generated = np.asarray(trace.generated)
  assert generated.shape == (2, G) and not (generated == qf.MASK_ID).any()
  assert (np.asarray(trace.decode_step) >= 0).all() and 0 < int(trace.nfe) <= G + G // 4


@pytest.mark.parametrize("variant, threshold", [("bd3lm", None), ("sdar", THRESHOLD)])
def test_block_variants_match_a_loop_on_transformers(models, variant, threshold):
  """BD3LM with dllm's quota rule (no threshold), SDAR with a threshold; exact KV cache."""
  config, params, reference = models[variant]
  trace = _generate(config, params, _block_options(config, threshold))
  assert not (np.asarray(trace.generated)[:, :G] == qf.MASK_ID).any()
  block = config.attention_block_size
  for row in range(len(PROMPTS)):
    expected = block_reference(reference, PROMPTS[row], block, block, 1.0 if threshold is None else threshold)
    np.testing.assert_array_equal(np.asarray(trace.tokens[row]), expected)


def _options(config):
  if config.attention_block_size is None:
    return llada.LLaDAOptions(gen_length=G, steps=G, block_length=4)
  return _block_options(config, 0.95)


@pytest.mark.parametrize("variant", ["mdlm", "sdar"])  # bd3lm: the same sampler as sdar
def test_statistics_and_sink_masking_on_each_variant(models, variant):
  """Incoming attention sums to the computed queries (every row a distribution); the keys masked at a call
  are the previous call's top sinks and receive no attention there."""
  config, params, _ = models[variant]
  trace = _generate(config, params, _options(config), stats_spec=StatsSpec(incoming_attention=True),
                    intervention=iv.MaskPreviousSinks(top_k=1), sink_top_k=1, record_intervention=True)
  n = int(trace.nfe)
  incoming = np.asarray(trace.stats["incoming_attention"])[:n]  # [steps, L, B, N, S]
  queries = np.diff(np.asarray(trace.computed_queries)[:n], axis=1)[:, 0]
  np.testing.assert_allclose(incoming.sum(-1), np.broadcast_to(queries[:, None, None, None], incoming.shape[:-1]),
                             rtol=1e-5)
  record, sinks = np.asarray(trace.intervention_record), np.asarray(trace.top_sinks)  # sinks [steps, L, B, N, 1]
  active = np.asarray(trace.active_rows)
  assert not record[0].any() and record[1:n].any()
  for step in range(1, n):
    for layer, row, head in np.ndindex(sinks.shape[1], sinks.shape[2], sinks.shape[3]):
      if not (active[step - 1, row] and active[step, row]):  # a waiting row keeps its state (block diffusion)
        continue
      assert np.flatnonzero(record[step, layer, row, head]).tolist() == [sinks[step - 1, layer, row, head, 0]]
      assert incoming[step, layer, row, head, sinks[step - 1, layer, row, head, 0]] == 0


@pytest.mark.parametrize("variant", ["mdlm", "sdar"])  # bd3lm: the same sampler as sdar
def test_sink_token_on_each_variant(models, variant):
  """The extra sink token at the front: its row sees only itself, so it receives at least its own 1 per
  step, layer and head; the generation is complete."""
  config, params, _ = models[variant]
  prompt = np.asarray(iv.add_sink_token(jnp.asarray(PROMPTS), SINK_ID))
  trace = _generate(config, params, _options(config), prompt=prompt, intervention=iv.SinkToken(),
                    stats_spec=StatsSpec(incoming_attention=True))
  n = int(trace.nfe)
  incoming = np.asarray(trace.stats["incoming_attention"])[:n]
  computes_sink = np.asarray(trace.computed_queries)[:n, 0] == 0
  assert (incoming[computes_sink][..., 0] >= 1 - 1e-5).all()
  assert not (np.asarray(trace.generated)[:, :G] == qf.MASK_ID).any()


def dllm_bd3lm_reference(reference, padded, valid, block, gen_length):
  """dllm's BD3LMSampler at temperature 0 (small_dlms.md §3.5): the prompt left-padded to a multiple of the
  block; pads are neither queries nor keys; position ids count the real tokens before a position; a query
  sees the keys of its block and earlier ones; one token per step (steps = block), the most confident."""
  x = np.concatenate([padded, np.full(gen_length, qf.MASK_ID)])
  real = np.concatenate([valid, np.ones(gen_length, bool)])
  positions = np.maximum(np.cumsum(real) - 1, 0)
  for start in range(len(padded), len(x), block):
    end = start + block
    index = np.arange(end)
    visible = (index[None, :] // block <= index[:, None] // block) & real[None, :end]
    visible |= np.eye(end, dtype=bool)  # a pad query sees itself only (its row is never read)
    mask = np.where(visible, 0.0, -np.inf).astype(np.float32)[None, None]
    for _ in range(block):
      with torch.no_grad():
        logits = reference(input_ids=torch.as_tensor(x[None, :end]), attention_mask=torch.as_tensor(mask),
                           position_ids=torch.as_tensor(positions[None, :end])).logits[0]
      probs = torch.softmax(logits.double(), -1).numpy()
      x0, p = probs.argmax(-1), probs.max(-1)
      candidates = np.flatnonzero(x[start:end] == qf.MASK_ID) + start
      best = candidates[np.argmax(p[candidates])]
      x[best] = x0[best]
  return x


def test_bd3lm_in_dllms_padded_layout_matches_its_sampler(models):
  """dllm's layout through the library: prompts left-padded to a block multiple with a prompt mask,
  threshold None (quota only), steps = block. Row 0 has pads (hidden keys), row 1 a full-width prompt."""
  config, params, reference = models["bd3lm"]
  block = config.attention_block_size
  padded = np.concatenate([np.ones((2, block - P), PROMPTS.dtype), PROMPTS], axis=1)
  valid = np.concatenate([np.zeros((2, block - P), bool), np.ones((2, P), bool)], axis=1)
  valid[1] = True
  padded[1, :block - P] = [7, 8][:block - P]
  options = block_diffusion.BlockDiffusionOptions(gen_length=2 * block, block_length=block, steps=block,
                                                  threshold=None, eos_stop=False)
  trace = _generate(config, params, options, prompt=padded, prompt_mask=jnp.asarray(valid))
  for row in range(2):
    expected = dllm_bd3lm_reference(reference, padded[row], valid[row], block, 2 * block)
    np.testing.assert_array_equal(np.asarray(trace.tokens[row]), expected)
