"""LLaDA `generate` and MMaDA text generation as one compiled program (`reference/models.md` §2.8, §4.5–4.6).

The sequence is [B, Lp + G]: the (left-padded) prompt, then G mask tokens. The G positions are split into
G / block_length blocks decoded left to right, each in steps / num_blocks steps. One `lax.scan` runs over
all steps; step i works on block i // steps_per_block and, at the first step of a block, computes that
block's per-row transfer schedule from the masks the block holds then. Each step:

  1. logits (CFG: conditional and unconditional sequences as one 2B batch,
     logits = un + (cfg_scale + 1)·(cond − un); the unconditional sequence has every position that was not a
     mask at the start, pads included, replaced by the mask token). The official code computes logits
     everywhere; positions after the current block get confidence −inf, but every position that still
     holds the mask token is a candidate, wherever it is. We compute the logits of the current block
     only while no earlier position (prompt included) holds the mask token — then only the block can
     transfer and the tokens are the same — and switch, inside the compiled loop (`lax.cond`), to
     whole-sequence logits at any step where one does: the prompt holds masks (infilling), or an earlier
     block kept one because its argmax was the mask id itself (possible under CFG). Such a position
     "transfers" the mask id, stays masked and competes for the transfer slots of later blocks, as in
     the official loop;
  2. `logits_eos_inf`: the EOS logit becomes −inf;
  3. x0 = argmax(logits) at temperature 0, else a Gumbel-max sample (see `gumbel_argmax`);
  4. `confidence_eos_eot_inf`, as the official code behaves (it aliases tensors): at temperature 0 the EOS
     and EoT logits used for the confidence are −inf (x0 was already chosen, so x0 may still be EOS, with
     confidence 0); at temperature > 0 only EoT's is;
  5. confidence: p(x0) under softmax(logits) (`low_confidence`) or U(0, 1) (`random`); −inf after the
     current block and at positions not holding the mask token;
  6. per row j, the schedule[j, s] most confident positions take x0. Ties are routine (at temperature 0
     with `confidence_eos_eot_inf` every position predicting EOS has confidence exactly 0) and go to the
     lowest index first.

Precision. LLaDA's confidence softmax runs in the model dtype (the dtype of the parameters; our logits
are float32 and are cast to it); MMaDA's in float64, which JAX provides only with `jax_enable_x64` — without
it the MMaDA confidence is float32. The official Gumbel noise is float64: argmax(exp(l) / (−log u)^T), which
equals argmax(l − T·log(−log u)) = argmax(l + T·g) with g standard Gumbel. We evaluate that log form:
in float64 (u uniform in float64) when x64 is enabled, otherwise in float32 — the argmax is the same
except that float32 u bounds the Gumbel tail at ≈ 16.6 instead of ≈ 36.7 and float64 exp(l) would
overflow only for logits above 709 (never met).

Padding policies (a left-padded batch, `prompt_mask` 1 = real token; `dlm_jax.sampling.padding`):
  * "visible": the original HF LLaDA (Feb 2025): pads are ordinary tokens, no mask at all;
  * "key":     the Oct-2025 HF update: pad keys are removed from every query's view;
  * "outer":   MMaDA's callers: a boolean outer product mask(i) ∧ mask(j) over prompt + generation, so pad
               queries see nothing (finite, uniform rows) and real queries never see pads. MMaDA's CFG
               branch calls the model with no mask at all (`cfg_padding=False`). (MMaDA's own code builds
               the outer product from the prompt-length mask only, which does not fit the longer sequence
               when a batch is padded; we extend the mask with ones over the generation, the evident intent.)
Positions are never shifted for left padding in the originals (all versions), so a row's tokens depend on
how much it is padded. `shift_positions=True` (not in the originals) gives real tokens the positions
0, 1, … of the unpadded prompt; with "key" or "outer" padding a row's result is then independent of its
padding (the batch-invariant layout).

Random draws (Gumbel noise at temperature > 0, random remasking) are drawn for the logits' window (the
block, or the whole sequence at the steps that need it), so a given key gives other samples than it would
over the whole sequence at every step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from dlm_jax import model
from dlm_jax.core.attention_bias import NO_BIAS, AttentionBias
from dlm_jax.config import ModelConfig
from dlm_jax.model import KVCache
from dlm_jax.sampling import blocks, decoding_rules, driver, keys, llada_blockwise, llada_rules, padding, parallel, \
    row_by_row
from dlm_jax.sampling.call_inputs import CallInputs, Guidance, Readout
from dlm_jax.sampling.schedules import llada_transfer_counts
from dlm_jax.sampling.selection import select_top_k, update_decode_step


@dataclasses.dataclass(frozen=True)
class LLaDAOptions(blocks.BlockLayout):
  """Static knobs of LLaDA's `generate` (defaults as in the official signature) and its MMaDA variants.

  Attributes:
    gen_length: G, number of generated positions (official default 128).
    steps: total denoising steps (official default 128); a multiple of the number of blocks.
    block_length: positions per block (official default 128; None = gen_length, pure diffusion); must
      divide gen_length.
    temperature: 0 for argmax, > 0 for Gumbel-max sampling at that temperature.
    cfg_scale: classifier-free guidance weight w (> 0 enables it): logits = un + (w + 1)·(cond − un).
    remasking: "low_confidence" or "random".
    logits_eos_inf: EOS can never be sampled.
    confidence_eos_eot_inf: the official (temperature-dependent) EOS/EoT confidence quirk; module docstring.
    padding: "visible", "key" or "outer" (module docstring); only used when a prompt mask is given.
    shift_positions: left-padded rows get positions cumsum(mask) − 1 (not in the originals; module
      docstring); only used when a prompt mask is given.
    cfg_padding: apply the padding policy to the CFG calls as well (MMaDA: False, no mask under CFG).
    confidence_dtype: None (the model dtype, LLaDA), "float32" or "float64" (MMaDA; float32 without x64).
    confidence_ranking: how `low_confidence` remasking ranks proposals: "probability" (the originals: p(x0)
      in confidence_dtype, which saturates — in float32 half the proposals of a trained tiny model have p
      exactly 1 — so most choices are ties settled by position) or "log_odds" (log p − log(1 − p) from the
      logits, `parallel.log_odds_confidence`, at least float32: the order exact arithmetic gives). Threshold
      and factor bounds are compared on the same scale.
    stop_token_id: MMaDA `mmu_generate_fast`: after a block, stop when every row's last position of that
      block holds this id (later blocks stay masks, their steps are skipped). None = never stop.
    mask_token_id, eos_token_id, eot_token_id: overrides of the config's ids (None = config).
    threshold: Fast-dLLM confidence-threshold parallel decoding: at each step every masked position of
      the current block whose confidence is >= threshold is transferred, and at least the most confident
      one; a block takes as many steps as it needs (`steps` is then unused). None = the quota rule.
    factor: Fast-dLLM's factor rule instead (`dlm_jax.sampling.parallel.factor_transfer`); not with
      threshold. None = off.
    factor_rule: "fast_dllm" (NVlabs' code, the default: when only the last-ranked candidate fails, all are
      committed), "dllm" (dllm's vectorised rule: exactly the accepted prefix) or "research_dllm" (Research
      dLLM's loop, which d2Cache's official runs use); `parallel.FACTOR_RULES`.
    cache: "none", "prefix" or "dual": Fast-dLLM's approximate KV caches, refreshed by a whole-sequence
      step at each block start (`dlm_jax.sampling.llada_blockwise`).
    dual_cache_forwards: with cache="dual", how many model calls a block may take: "until_done" (NVlabs'
      June-2025 code, 24cc59e: until the block holds no mask) or "steps_per_block" (NVlabs' current code:
      at most steps / num_blocks calls, the refresh included; masks a block leaves compete with the next
      blocks' candidates at their refresh steps, and the output can end with mask ids).
    window: Elastic-Cache's sliding window (`dlm_jax.sampling.sliding_window`): a step's candidates are the
      first `window` masked positions of the block (with block_length None: of the generation, as the official
      `generate_with_elastic_cache`). None = every masked position of the block.
    eos_truncation: Elastic-Cache's EOS rule: after the first step that decodes the EOS id (config or
      eos_token_id), the masks after the first EOS it decoded are never decoded (they stay masks) and the run
      ends when no row has a candidate left. window and eos_truncation need threshold or factor decoding,
      cache "none" and no rule; `elastic_cache_options` gives the official configuration.
    Any of threshold, factor or a cache selects the block-by-block modes of `llada_blockwise`; with none
    of them this is the exact sampler above.
    rule: one of the decoding rules of `dlm_jax.sampling.decoding_rules` (`EBSampler`, `KLASS`, `WINO`,
      `PCSampler`, `CertaintyPrior`), run by `dlm_jax.sampling.llada_rules`; None = LLaDA's own rules above.
      Not with threshold, factor, random remasking or a stop token, WINO not with a cache or CFG; with a cache
      in Research dLLM's order (`llada_rules`), under CFG on the guided logits; the rules read p(x0) whatever
      `confidence_ranking` says.
  """

  gen_length: int = 128
  steps: int = 128
  block_length: int | None = 128
  temperature: float = 0.0
  cfg_scale: float = 0.0
  remasking: Literal["low_confidence", "random"] = "low_confidence"
  logits_eos_inf: bool = False
  confidence_eos_eot_inf: bool = False
  padding: padding.PaddingAttention = "visible"
  shift_positions: bool = False
  cfg_padding: bool = True
  confidence_dtype: Literal["float32", "float64"] | None = None
  confidence_ranking: Literal["probability", "log_odds"] = "probability"
  stop_token_id: int | None = None
  mask_token_id: int | None = None
  eos_token_id: int | None = None
  eot_token_id: int | None = None
  threshold: float | None = None
  factor: float | None = None
  factor_rule: Literal["fast_dllm", "dllm", "research_dllm"] = "fast_dllm"
  cache: Literal["none", "prefix", "dual"] = "none"
  dual_cache_forwards: Literal["until_done", "steps_per_block"] = "until_done"
  rule: decoding_rules.Rule | None = None
  window: int | None = None
  eos_truncation: bool = False

  def __post_init__(self):
    if isinstance(self.gen_length, bool) or not isinstance(self.gen_length, int) or self.gen_length <= 0:
      raise ValueError(f"gen_length must be a positive integer, got {self.gen_length!r}.")
    if self.block_length is not None and (isinstance(self.block_length, bool) or not isinstance(self.block_length, int)
                                          or self.block_length <= 0):
      raise ValueError(f"block_length must be a positive integer or None, got {self.block_length!r}.")
    if self.gen_length % self.block:
      raise ValueError(f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block}); "
                       "change one of them.")
    steps_ok = not isinstance(self.steps, bool) and isinstance(self.steps, int) and self.steps > 0
    if not steps_ok or self.steps % self.num_blocks:
      raise ValueError(f"steps ({self.steps}) must be a positive multiple of the number of blocks "
                       f"gen_length / block_length = {self.num_blocks}.")
    if self.temperature < 0 or self.cfg_scale < 0:
      raise ValueError(f"temperature and cfg_scale must be >= 0, got {self.temperature}, {self.cfg_scale}.")
    if self.remasking not in ("low_confidence", "random"):
      raise ValueError(f"remasking must be 'low_confidence' or 'random', got {self.remasking!r}.")
    if self.padding not in padding.PADDING_ATTENTION:
      raise ValueError(f"padding must be 'visible', 'key' or 'outer', got {self.padding!r}.")
    if self.confidence_dtype not in (None, "float32", "float64"):
      raise ValueError(f"confidence_dtype must be None, 'float32' or 'float64', got {self.confidence_dtype!r}.")
    if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
      raise ValueError(f"threshold must be in [0, 1] (a confidence) or None, got {self.threshold!r}.")
    if self.factor is not None and not self.factor > 0.0:
      raise ValueError(f"factor must be > 0 or None, got {self.factor!r}.")
    if self.threshold is not None and self.factor is not None:
      raise ValueError("set threshold or factor, not both (they are two transfer rules).")
    if self.cache not in ("none", "prefix", "dual"):
      raise ValueError(f"cache must be 'none', 'prefix' or 'dual', got {self.cache!r}.")
    if self.confidence_ranking not in parallel.SCALES:
      raise ValueError(f"confidence_ranking must be one of {', '.join(parallel.SCALES)}, got "
                       f"{self.confidence_ranking!r}.")
    if self.factor_rule not in parallel.FACTOR_RULES:
      raise ValueError(f"factor_rule must be one of {', '.join(parallel.FACTOR_RULES)}, got {self.factor_rule!r}.")
    if self.dual_cache_forwards not in ("until_done", "steps_per_block"):
      raise ValueError("dual_cache_forwards must be 'until_done' or 'steps_per_block', got "
                       f"{self.dual_cache_forwards!r}.")
    if self.dual_cache_forwards != "until_done" and self.cache != "dual":
      raise ValueError(f"dual_cache_forwards={self.dual_cache_forwards!r} applies to cache='dual' only, got "
                       f"cache={self.cache!r}.")
    if self.cache != "none" and self.cfg_scale > 0:
      raise ValueError(f"cache={self.cache!r} cannot be combined with cfg_scale > 0 (classifier-free guidance "
                       "would need a cache for the unconditional sequence); use cache='none'.")
    if self.rule is not None:
      decoding_rules.check_llada_options(self)
    if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                    or self.window <= 0):
      raise ValueError(f"window must be a positive integer or None, got {self.window!r}.")
    if not isinstance(self.eos_truncation, bool):
      raise ValueError(f"eos_truncation must be True or False, got {self.eos_truncation!r}.")
    elastic = self.window is not None or self.eos_truncation
    if elastic and (self.threshold is None and self.factor is None or self.cache != "none" or self.rule is not None):
      raise ValueError("window and eos_truncation (Elastic-Cache's decoding) run with threshold or factor decoding, "
                       f"cache='none' and no rule; got threshold={self.threshold}, factor={self.factor}, "
                       f"cache={self.cache!r}, rule={type(self.rule).__name__ if self.rule else None}.")

  @property
  def blockwise(self) -> bool:
    """The block-by-block modes (threshold, factor or a cache) rather than the exact sampler."""
    return self.threshold is not None or self.factor is not None or self.cache != "none"



def mmada_options(**overrides: Any) -> LLaDAOptions:
  """MMaDA's `generate` / `mmu_generate` (models.md §4.6): float64 confidence, the bool outer-product
  padding mask (none under CFG), no EOS knobs. For `mmu_generate_fast` pass stop_token_id=<eot id>."""
  values = dict(padding="outer", cfg_padding=False, confidence_dtype="float64")
  values.update(overrides)
  return LLaDAOptions(**values)


def elastic_cache_options(**overrides: Any) -> LLaDAOptions:
  """The decoding of Elastic-Cache's `generate_with_elastic_cache` (signature defaults; `llada/generate.py` of
  VILA-Lab/Elastic-Cache): gen 512 in one block, threshold 0.9 (at least the best token), the sliding window of
  16 masked positions, EOS truncation. Its LLaDA eval scripts run window 1024 (`eval_llada.py`'s default; they
  do not pass theirs on): pass window=None (and the policy's window_length >= gen_length) for that. Run with
  policy `elastic_cache` of the same window_length (`dlm_jax.policy.elastic_cache_policy`)."""
  values = dict(gen_length=512, steps=512, block_length=None, threshold=0.9, window=16, eos_truncation=True)
  values.update(overrides)
  if "gen_length" in overrides and "steps" not in overrides:
    values["steps"] = values["gen_length"]
  return LLaDAOptions(**values)


def gumbel_argmax(logits: jax.Array, temperature: float, key: jax.Array, per_row: bool = False) -> jax.Array:
  """argmax over the last axis of l − T·log(−log u), u ~ U(0, 1): an exact sample of softmax(l / T).

  Float64 when `jax_enable_x64` is on (as the official code), float32 otherwise. [..., V] -> [...] int32.
  per_row: `key` is [B] keys for logits [B, ..., V] (`dlm_jax.sampling.keys`).
  """
  dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
  u = keys.uniform(key, logits.shape, dtype, jnp.finfo(dtype).tiny, 1.0, per_row)
  scores = logits.astype(dtype) - jnp.asarray(temperature, dtype) * jnp.log(-jnp.log(u))
  return jnp.argmax(scores, axis=-1).astype(jnp.int32)


@struct.dataclass
class LLaDAConstants:
  """Loop invariants: the padding layout, the unconditional sequence's padding bias and the CFG prompt
  index ([B, S] bool, positions that were not masks at the start)."""

  layout: padding.PaddingLayout
  uncond_bias: AttentionBias
  prompt_index: jax.Array


@struct.dataclass
class LLaDACarry:
  """tokens [B, S]; key; schedule [B, steps_per_block] transfer counts of the current block; decode_step
  [B, G]; block_step: steps taken in the current block, block: the current block (the one-phase layout)
  and cache: the `KVCache` (block-by-block modes)."""

  tokens: jax.Array
  key: jax.Array
  schedule: jax.Array
  decode_step: jax.Array
  block_step: jax.Array | None = None
  block: jax.Array | None = None
  cache: KVCache | None = None


@dataclasses.dataclass(frozen=True)
class LLaDAFamily(driver.MaskedDiffusionFamily):
  """LLaDA / MMaDA semi-autoregressive block decoding (module docstring) with resolved special ids."""

  eos_id: int | None
  eot_id: int | None

  name = "llada"
  runs_policies = True

  @property
  def padding_attention(self) -> padding.PaddingAttention:
    return self.options.padding

  @property
  def shift_positions(self) -> bool:
    return self.options.shift_positions

  def constants(self, run, sequence, layout) -> LLaDAConstants:
    uncond_bias = layout.bias if self.options.cfg_padding else NO_BIAS
    return LLaDAConstants(layout=layout, uncond_bias=uncond_bias, prompt_index=sequence != self.mask_id)

  def init_carry(self, run, params, sequence, key, consts) -> LLaDACarry:
    b, o = sequence.shape[0], self.options
    return LLaDACarry(tokens=sequence, key=key, schedule=jnp.zeros((b, o.steps_per_block), jnp.int32),
                      decode_step=jnp.full((b, o.gen_length), -1, jnp.int32),
                      block_step=jnp.zeros((), jnp.int32), block=jnp.zeros((), jnp.int32),
                      cache=blocks.init_cache(run, params, b))

  def _confidence_dtype(self, params) -> Any:
    if self.options.confidence_dtype is None:
      return params["embed"]["embedding"].dtype
    if self.options.confidence_dtype == "float64" and jax.config.jax_enable_x64:
      return jnp.float64
    return jnp.float32

  def _proposals(self, params, logits, uncond_logits, key, per_row: bool = False):
    """Steps 1–5 of the module docstring on the logits [B, W, V] of a window (and of the unconditional
    sequence under CFG): (x0 [B, W] int32, confidence p(x0) [B, W]). per_row: `key` is [B] keys."""
    o = self.options
    if o.cfg_scale > 0:
      logits = uncond_logits + (o.cfg_scale + 1.0) * (logits - uncond_logits)
    if o.logits_eos_inf:
      logits = logits.at[..., self.eos_id].set(-jnp.inf)
    noise_key, random_key = keys.split(key, 2, per_row)
    if o.temperature == 0:
      x0 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
      x0 = gumbel_argmax(logits, o.temperature, noise_key, per_row)
    confidence_logits = logits
    if o.confidence_eos_eot_inf:
      if o.temperature == 0:
        confidence_logits = confidence_logits.at[..., self.eos_id].set(-jnp.inf)
      confidence_logits = confidence_logits.at[..., self.eot_id].set(-jnp.inf)
    if o.remasking == "low_confidence" and o.confidence_ranking == "log_odds":
      dtype = jnp.float64 if self._confidence_dtype(params) == jnp.float64 else jnp.float32
      x0_p = parallel.log_odds_confidence(confidence_logits.astype(dtype), x0)
    elif o.remasking == "low_confidence":
      probs = jax.nn.softmax(confidence_logits.astype(self._confidence_dtype(params)), axis=-1)
      x0_p = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    else:
      x0_p = keys.uniform(random_key, x0.shape, jnp.float32, 0.0, 1.0, per_row)
    return x0, x0_p

  def _transfer(self, x, x0, x0_p, block_end, transfer_count):
    """Step 6 on the whole sequence x [B, S]: the transfer_count [B] most confident masked positions before
    block_end take x0 [B, S] (confidence x0_p [B, S], −inf where no proposal was computed)."""
    masked = x == self.mask_id
    before_end = jnp.arange(x.shape[1])[None, :] < block_end
    confidence = jnp.where(masked & before_end, x0_p, -jnp.inf)
    return jnp.where(select_top_k(confidence, transfer_count), jnp.where(masked, x0, x), x)

  @property
  def confidence_scale(self) -> str:
    """The scale of `_proposals`' confidence (`parallel.SCALES`): log odds when ranked so, else a
    probability (random remasking's U(0, 1) included)."""
    o = self.options
    return "log_odds" if o.remasking == "low_confidence" and o.confidence_ranking == "log_odds" else "probability"

  @property
  def can_finish_early(self) -> bool:
    return self.options.stop_token_id is not None

  def block_index(self, run, before, after, i, phase_index):
    """Semi-autoregressive blocks: step i works on block i // steps_per_block."""
    return jnp.asarray(i // self.options.steps_per_block, jnp.int32)

  def n_blocks(self, run) -> int:
    return self.options.num_blocks

  def finished(self, run, consts, carry: LLaDACarry, i, phase):
    """MMaDA's early stop: at a block start after the first, every row's previous position holds the stop id
    (the later steps are skipped)."""
    o = self.options
    block, s = i // o.steps_per_block, i % o.steps_per_block
    last = jax.lax.dynamic_index_in_dim(carry.tokens, jnp.maximum(run.prompt_length + block * o.block - 1, 0),
                                        axis=1, keepdims=False)
    return (s == 0) & (block > 0) & jnp.all(last == o.stop_token_id)

  def step(self, run, params, consts: LLaDAConstants, carry: LLaDACarry, istate, i, phase):
    o, mask_id, lp = self.options, self.mask_id, run.prompt_length
    block, s = i // o.steps_per_block, i % o.steps_per_block
    block_start = lp + block * o.block
    x = carry.tokens
    block_tokens = jax.lax.dynamic_slice_in_dim(x, block_start, o.block, axis=1)
    new_schedule = llada_transfer_counts(jnp.sum(block_tokens == mask_id, axis=1), o.steps_per_block)
    schedule = jnp.where(s == 0, new_schedule, carry.schedule)
    key, step_key = keys.split(carry.key, 2, run.row_keys)
    uncond = jnp.where(consts.prompt_index, mask_id, x) if o.cfg_scale > 0 else None

    def proposals(result, whole_sequence: bool):
      """(x0, confidence) [B, S] from the logits of the whole sequence, or of the current block only
      (confidence −inf elsewhere)."""
      def propose(_):
        start, width = (0, run.total_length) if whole_sequence else (block_start, o.block)
        head = lambda h: model.lm_head(params, h, config=run.config)
        if run.caller.batch_invariant:
          head = functools.partial(row_by_row.lm_head_rows, head)
        logits = [None if h is None else head(jax.lax.dynamic_slice_in_dim(h, start, width, 1))
                  for h in (result.hidden, result.uncond_hidden)]
        x0, x0_p = self._proposals(params, *logits, step_key, run.row_keys)
        full_p = jnp.full(x.shape, -jnp.inf, x0_p.dtype)
        return (jax.lax.dynamic_update_slice_in_dim(x, x0, start, axis=1),
                jax.lax.dynamic_update_slice_in_dim(full_p, x0_p, start, axis=1))
      return propose

    inputs = CallInputs(x, consts.layout.positions, consts.layout.valid, consts.layout.valid, consts.layout.bias,
                        block_start=block_start, block_step=s)
    result = run.caller(params, i, istate, inputs, Readout(hidden=True),
                        guidance=None if uncond is None else Guidance(uncond, consts.uncond_bias))
    earlier_mask = jnp.any((x == mask_id) & (jnp.arange(x.shape[1]) < block_start)[None, :])
    x0, x0_p = jax.lax.cond(earlier_mask, proposals(result, True), proposals(result, False), None)
    new_x = self._transfer(x, x0, x0_p, block_start + o.block, schedule[:, s])
    istate, outputs = result.state, result.outputs
    decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], mask_id, i)
    carry = carry.replace(tokens=new_x, key=key, schedule=schedule, decode_step=decode_step)
    return carry, istate, outputs


@dataclasses.dataclass(frozen=True)
class LLaDABlockwiseFamily(LLaDAFamily):
  """LLaDA / MMaDA's block-by-block modes (`dlm_jax.sampling.llada_blockwise`: threshold or factor parallel
  decoding, prefix or dual KV cache): the exact family's proposals, blocks and carry, its own phases, early
  finish and model calls."""

  name = "llada_blockwise"
  runs_policies = True
  can_finish_early = True

  def check_policy(self, name: str) -> None:
    """Threshold and factor decoding, with a cache only the policies that compose with it
    (`blocks.check_policy_cache`), not NVlabs' capped dual cache."""
    blocks.check_policy_cache(self.options.cache, name)
    if self.options.cache == "dual" and self.options.dual_cache_forwards == "steps_per_block":
      raise ValueError(f"policy {name!r} does not run with dual_cache_forwards='steps_per_block' (its refresh "
                       "proposes at every position); use dual_cache_forwards='until_done'.")

  def phases(self, run) -> tuple[driver.Phase, ...]:
    return llada_blockwise.phases(self.options)

  def block_index(self, run, before, after, i, phase_index):
    """The phase's block, or the carry's after the step (`driver.Family.block_index`)."""
    return driver.Family.block_index(self, run, before, after, i, phase_index)

  def finished(self, run, consts, carry: LLaDACarry, i, phase):
    """A block every row has finished, or (MMaDA's stop id) at a block start every row's previous position
    holds the stop id (`llada_blockwise.finished`)."""
    return llada_blockwise.finished(self, run, carry, phase)

  def open_phase(self, run, params, consts: LLaDAConstants, carry: LLaDACarry, istate, i, phase):
    """A cached block's first step: the whole sequence, refreshing the cache."""
    return llada_blockwise.decode(self, run, params, consts, carry, istate, i, phase, "refresh")

  def step(self, run, params, consts: LLaDAConstants, carry: LLaDACarry, istate, i, phase):
    call = {"none": "full", "prefix": "prefix", "dual": "dual"}[self.options.cache]
    return llada_blockwise.decode(self, run, params, consts, carry, istate, i, phase, call)


@dataclasses.dataclass(frozen=True)
class LLaDARuleFamily(llada_rules.RuleFamilyMixin, LLaDAFamily):
  """LLaDA / MMaDA under a decoding rule (`LLaDAOptions.rule`; `dlm_jax.sampling.llada_rules`)."""

  name = "llada_rules"
  runs_policies = True
  can_finish_early = True

  def check(self, config, intervention) -> None:
    llada_rules.check(self, config, intervention)

  def check_policy(self, name: str) -> None:
    llada_rules.check_policy(self, name)

  def constants(self, run, sequence, layout):
    return llada_rules.constants(self, super().constants(run, sequence, layout))

  def _proposals(self, params, logits, uncond_logits, key, per_row: bool = False):
    """LLaDA's proposals with the confidence p(x0) the rules read (`confidence_ranking` does not apply), from
    logits already guided under CFG (`llada_rules._call`)."""
    probability = dataclasses.replace(self, options=dataclasses.replace(self.options, confidence_ranking="probability",
                                                                        cfg_scale=0.0))
    return LLaDAFamily._proposals(probability, params, logits, uncond_logits, key, per_row)


def _special_ids(config: ModelConfig, options: LLaDAOptions) -> tuple[int, int | None, int | None]:
  mask_id = config.mask_token_id if options.mask_token_id is None else options.mask_token_id
  eos_id = config.eos_token_id if options.eos_token_id is None else options.eos_token_id
  eot_id = config.eot_token_id if options.eot_token_id is None else options.eot_token_id
  if mask_id is None:
    raise ValueError("LLaDA sampling needs a mask token id: set ModelConfig.mask_token_id or options.mask_token_id.")
  if (options.logits_eos_inf or options.confidence_eos_eot_inf) and eos_id is None:
    raise ValueError("logits_eos_inf / confidence_eos_eot_inf need an EOS id (config or options.eos_token_id).")
  if options.eos_truncation and eos_id is None:
    raise ValueError("eos_truncation needs an EOS id (config.eos_token_id or options.eos_token_id).")
  if options.confidence_eos_eot_inf and eot_id is None:
    raise ValueError("confidence_eos_eot_inf needs an EoT id (config.eot_token_id or options.eot_token_id).")
  return mask_id, eos_id, eot_id


def _family(config: ModelConfig, options: LLaDAOptions, prompt) -> LLaDAFamily:
  """The exact family, or the block-by-block one when the options ask for a block mode."""
  del prompt
  mask_id, eos_id, eot_id = _special_ids(config, options)
  family = LLaDABlockwiseFamily if options.blockwise else LLaDAFamily
  if options.rule is not None:
    family = LLaDARuleFamily
  return family(options=options, mask_id=mask_id, eos_id=eos_id, eot_id=eot_id)


generate = driver.public_sampler(_family, LLaDAOptions(), """LLaDA / MMaDA masked-diffusion generation (module
docstring), one compiled program per shape.

Args:
  params: model parameters.
  prompt: [B, Lp] int token ids, left-padded for batches.
  config: model config (static).
  options: `LLaDAOptions` (static; `mmada_options(...)` for MMaDA).
  key: PRNG key (temperature > 0, random remasking); default key(0); or [B] keys, one per row.
  prompt_mask, setup: see `dlm_jax.sampling.driver.run_family` (`setup`: a `RunSetup`; old keywords such
    as stats_spec= are deprecated).

Returns:
  `Trace` with tokens [B, Lp + G], decode_step [B, G], nfe, stats [steps, ...], top_sinks.
""")
