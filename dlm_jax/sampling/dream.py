"""Dream's `diffusion_generate` as one compiled program (`reference/models.md` §3.5–3.8).

The sequence is [B, Lp + G]: the left-padded prompt, then G mask tokens. `timesteps` are
`torch.linspace(1, eps, steps + 1)` in float32, bit for bit (`schedules.dream_timesteps`). Step i, with
t = ts[i] and s = ts[i + 1]:

  1. logits, shifted by one position: the prediction for position p is the model output at p − 1
     (position 0 reuses its own output; `dlm_jax.config.logit_shift`); only the outputs needed for the
     masked region are computed;
  2. `sample_tokens`: divide by the temperature (if > 0), top-p then top-k filtering (removed logits become
     finfo(float32).min), probs = softmax; x0 ~ probs (temperature > 0) or argmax, with confidence p(x0);
     `topk_margin`: confidence = top1 − top2 probability; `entropy`: confidence = Σ p·log(p + 1e-10);
  3. `origin`: each masked position is revealed independently with probability 1 − s/t (1 at the last
     step) and takes its sample;
     other algs: k = int(M̄·(1 − s/t)) (int(M̄) at the last step) with M̄ = masked count of the batch / B in
     float32, the same k for every row (it may be 0); the k most confident positions of each row
     (confidence −inf where not masked; ties, routine at temperature 0: lowest index first) — or, with
     alg_temp > 0, k positions drawn without replacement from softmax(confidence / alg_temp) (Gumbel
     top-k) — take x0. As in the original, a chosen position that was not masked (only when k exceeds a
     row's masked count) is set to the mask token.

Left padding (`prompt_mask` given; `dlm_jax.sampling.padding`): positions are cumsum(mask) − 1 with pads
at 1, and the attention mask is the boolean outer product mask(i) ∧ mask(j) (pad queries see nothing:
finite uniform rows).
Without a prompt mask the model is fully bidirectional with positions 0..S−1, as the original's "full".

The original's `generation_tokens_hook_func` / `generation_logits_hook_func` are not offered; attention-side
changes go through interventions.

Block modes (`DreamOptions.block_length` set; `dlm_jax.sampling.dream_blockwise`): Fast-dLLM's Dream code —
blocks of B positions after the prompt, decoded left to right; each block opens with a whole-sequence step
that commits its first position unconditionally (the cache refresh with a cache), then steps that decode
the rest of the block by the confidence threshold (`threshold`), the factor rule (`factor`) or the
per-block timestep quota (neither), with no cache, the prefix KV cache or the dual KV cache (`cache`).
With block_length None this module's exact sampler runs, unchanged.

Elastic-Cache's Dream decoding (`DreamOptions.window` / `eos_truncation`, `elastic_cache_options()`;
`dlm_jax.sampling.dream_window`): no blocks; every call, threshold (or factor) decoding among the first `window`
masks of the generation, and after the first call that decodes the EOS id the masks after it are never decoded;
the run ends when no mask is left to decode.

Precision: logits, softmax and confidences are float32 (the original computes them in the model dtype,
bf16 for the released weights); compare at temperature 0 in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig, logit_shift
from dlm_jax.instrument.interventions import Intervention
from dlm_jax.model import KVCache
from dlm_jax.sampling import blocks, decoding_rules, dream_blockwise, dream_window, driver, keys, llada_rules, padding
from dlm_jax.sampling.call_inputs import CallInputs, Readout
from dlm_jax.sampling.parallel import FACTOR_RULES
from dlm_jax.sampling.schedules import dream_transfer_count, dream_transfer_fractions
from dlm_jax.sampling.selection import filter_top_k, filter_top_p, select_top_k, update_decode_step

Alg = Literal["origin", "maskgit_plus", "topk_margin", "entropy"]


@dataclasses.dataclass(frozen=True)
class DreamOptions(blocks.BlockLayout):
  """Static knobs of Dream's `diffusion_generate` (defaults of its generation_config, models.md §3.2).

  Attributes:
    gen_length: G = max_new_tokens.
    steps: denoising steps (the loop always runs exactly this many).
    eps: last timestep.
    alg: "origin", "maskgit_plus", "topk_margin" or "entropy".
    alg_temp: None or 0 for deterministic top-k positions, > 0 to sample positions.
    temperature: 0 for argmax tokens, > 0 to sample.
    top_p: nucleus filtering (None or >= 1 = off).
    top_k: top-k filtering (None = off).
    mask_token_id: override of the config's mask id.
    block_length: None (the exact sampler above) or B, which selects Fast-dLLM's block-by-block modes
      (`dlm_jax.sampling.dream_blockwise`): G / B blocks decoded left to right, each opened by a step that
      commits its first position unconditionally. B must divide gen_length.
    threshold: block modes: Fast-dLLM's confidence-threshold rule (alg='confidence_threshold'): at each
      step the block's most confident mask and every mask with p(x0) >= threshold take their proposal; a
      block takes the steps it needs (`steps` is then unused). None = off.
    factor: block modes: Fast-dLLM's factor rule on p(x0) instead (`parallel.factor_transfer`); not with
      threshold. None = off.
    factor_rule: the factor rule's variant, "fast_dllm" (NVlabs' LLaDA code, the default), "dllm" or
      "research_dllm" (`parallel.FACTOR_RULES`).
    With neither, the block modes use Fast-dLLM's per-block quota: steps / num_blocks steps per block
      (at least 2 when B > 1), ranked by alg's confidence ("maskgit_plus", "topk_margin" or "entropy").
      With either, alg must stay "origin" (the default) or be "maskgit_plus" (both: p(x0)), alg_temp unset.
    cache: block modes: "none" (every step runs the whole sequence), "prefix" or "dual" (Fast-dLLM's
      approximate KV caches, refreshed by each block-start step).
    window: Elastic-Cache's sliding window (`dlm_jax.sampling.dream_window`): a call's candidates are the first
      `window` masks of the generation. None = every mask.
    eos_truncation: Elastic-Cache's EOS rule: after the first call that decodes the EOS id (config or
      eos_token_id), the masks after the first EOS it decoded are never decoded (they stay masks) and the run ends
      when no row has a candidate left. window and eos_truncation select Elastic-Cache's Dream decoding
      (`dream_window`: no blocks, threshold or factor over the window, no cache, no rule; block_length None, alg
      'origin' or 'maskgit_plus', alg_temp unset, `steps` unused); `elastic_cache_options` gives the official one.
    eos_token_id: override of the config's EOS id (eos_truncation).
  """

  gen_length: int = 512
  steps: int = 512
  eps: float = 1e-3
  alg: Alg = "origin"
  alg_temp: float | None = None
  temperature: float = 0.0
  top_p: float | None = None
  top_k: int | None = None
  mask_token_id: int | None = None
  block_length: int | None = None
  threshold: float | None = None
  factor: float | None = None
  factor_rule: Literal["fast_dllm", "dllm", "research_dllm"] = "fast_dllm"
  cache: Literal["none", "prefix", "dual"] = "none"
  rule: decoding_rules.Rule | None = None
  window: int | None = None
  eos_truncation: bool = False
  eos_token_id: int | None = None

  def __post_init__(self):
    if not isinstance(self.gen_length, int) or self.gen_length <= 0:
      raise ValueError(f"gen_length must be a positive integer, got {self.gen_length!r}.")
    if not isinstance(self.steps, int) or self.steps <= 0:
      raise ValueError(f"steps must be a positive integer, got {self.steps!r}.")
    if self.alg not in ("origin", "maskgit_plus", "topk_margin", "entropy"):
      raise ValueError(f"alg must be origin, maskgit_plus, topk_margin or entropy, got {self.alg!r}.")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
    if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k <= 0):
      raise ValueError(f"top_k must be None or a positive integer, got {self.top_k!r}.")
    if self.top_p is not None and self.top_p <= 0:
      raise ValueError(f"top_p must be None or > 0, got {self.top_p!r}.")
    if self.alg_temp is not None and self.alg_temp < 0:
      raise ValueError(f"alg_temp must be None or >= 0, got {self.alg_temp!r}.")
    if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
      raise ValueError(f"threshold must be in [0, 1] (a confidence) or None, got {self.threshold!r}.")
    if self.factor is not None and not self.factor > 0.0:
      raise ValueError(f"factor must be > 0 or None, got {self.factor!r}.")
    if self.threshold is not None and self.factor is not None:
      raise ValueError("set threshold or factor, not both (they are two transfer rules).")
    if self.cache not in ("none", "prefix", "dual"):
      raise ValueError(f"cache must be 'none', 'prefix' or 'dual', got {self.cache!r}.")
    if self.factor_rule not in FACTOR_RULES:
      raise ValueError(f"factor_rule must be one of {', '.join(FACTOR_RULES)}, got {self.factor_rule!r}.")
    if self.eos_token_id is not None and self.eos_truncation is not True:
      raise ValueError(f"eos_token_id ({self.eos_token_id}) is the EOS id of eos_truncation (Elastic-Cache's "
                       "decoding); set eos_truncation=True or leave eos_token_id None.")
    if self.windowed:
      self._check_window()
      return
    if self.rule is not None:
      decoding_rules.check_dream_options(self)
      return
    if self.block_length is None:
      if self.threshold is not None or self.factor is not None or self.cache != "none":
        raise ValueError("threshold, factor and cache are Fast-dLLM's block-by-block modes: set block_length "
                         "(block_length=gen_length for one block), or window / eos_truncation for Elastic-Cache's "
                         "decoding.")
      return
    if isinstance(self.block_length, bool) or not isinstance(self.block_length, int) or self.block_length <= 0:
      raise ValueError(f"block_length must be a positive integer or None, got {self.block_length!r}.")
    if self.gen_length % self.block_length:
      raise ValueError(f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block_length}).")
    if self.threshold is not None or self.factor is not None:
      if self.alg not in ("origin", "maskgit_plus"):
        raise ValueError(f"threshold and factor compare the proposal's probability p(x0); alg={self.alg!r} ranks "
                         "by another confidence. Leave alg at 'origin' or use 'maskgit_plus'.")
      if self.alg_temp:
        raise ValueError("alg_temp samples positions for the quota rule; threshold and factor choose them by "
                         "confidence. Leave alg_temp unset.")
      return
    if self.alg == "origin":
      raise ValueError("alg='origin' reveals positions at random and has no block mode: with block_length set "
                       "use alg 'maskgit_plus', 'topk_margin' or 'entropy' (Fast-dLLM's quota ranks by entropy), "
                       "or a threshold.")
    if self.steps % self.num_blocks:
      raise ValueError(f"steps ({self.steps}) must be a multiple of the number of blocks gen_length / "
                       f"block_length = {self.num_blocks}.")
    if self.block_length > 1 and self.steps_per_block < 2:
      raise ValueError(f"steps / num_blocks = {self.steps_per_block} step per block: the block-start step decodes "
                       "only the block's first position, so the quota needs at least 2 steps per block; raise steps.")

  def _check_window(self) -> None:
    """window and eos_truncation: their values, and the options Elastic-Cache's Dream decoding runs with."""
    if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                    or self.window <= 0):
      raise ValueError(f"window must be a positive integer or None, got {self.window!r}.")
    if not isinstance(self.eos_truncation, bool):
      raise ValueError(f"eos_truncation must be True or False, got {self.eos_truncation!r}.")
    if (self.threshold is None and self.factor is None or self.block_length is not None or self.cache != "none"
        or self.rule is not None):
      raise ValueError("window and eos_truncation (Elastic-Cache's Dream decoding) run with threshold or factor "
                       f"decoding, no blocks, cache='none' and no rule; got threshold={self.threshold}, factor="
                       f"{self.factor}, block_length={self.block_length}, cache={self.cache!r}, "
                       f"rule={type(self.rule).__name__ if self.rule else None}.")
    if self.alg not in ("origin", "maskgit_plus") or self.alg_temp:
      raise ValueError(f"window and eos_truncation decode by the proposal's probability p(x0) (the official loop "
                       f"passes no alg): leave alg at 'origin' or use 'maskgit_plus', alg_temp unset; got "
                       f"alg={self.alg!r}, alg_temp={self.alg_temp!r}.")

  @property
  def windowed(self) -> bool:
    """Elastic-Cache's Dream decoding (`dream_window`): window or eos_truncation set."""
    return self.window is not None or self.eos_truncation is not False

  @property
  def blockwise(self) -> bool:
    """Fast-dLLM's block-by-block modes (`dream_blockwise`) rather than the exact sampler."""
    return self.block_length is not None and self.rule is None and not self.windowed


def elastic_cache_options(**overrides) -> DreamOptions:
  """The decoding of Elastic-Cache's Dream `_sample` (`dream/model/generation_utils_elastic.py` of
  VILA-Lab/Elastic-Cache; `dream_window`): gen 512 without blocks, threshold 0.9 (at least the best token) over the
  sliding window of 16 masked positions (its signature default; the scripts `dream/eval_gsm8k.sh` and
  `eval_humaneval.sh` pass 32 and 16), EOS truncation, temperature 0. Run with policy `elastic_cache` of the same
  window_length (`dlm_jax.policy.elastic_cache_policy`)."""
  values = dict(gen_length=512, steps=512, threshold=0.9, window=16, eos_truncation=True)
  values.update(overrides)
  return DreamOptions(**values)



def sample_tokens(logits: jax.Array, key: jax.Array, *, temperature: float, top_p: float | None,
                  top_k: int | None, margin: bool = False, neg_entropy: bool = False, per_row: bool = False):
  """Dream's `sample_tokens`: logits [..., V] -> (confidence [...] float32, x0 [...] int32).
  per_row: `key` is [B] keys for logits [B, ..., V]."""
  logits = logits.astype(jnp.float32)
  if temperature > 0:
    logits = logits / temperature
  if top_p is not None and top_p < 1:
    logits = filter_top_p(logits, top_p)
  if top_k is not None:
    logits = filter_top_k(logits, top_k)
  probs = jax.nn.softmax(logits, axis=-1)
  if temperature > 0:
    x0 = keys.categorical(key, logits, per_row).astype(jnp.int32)
    confidence = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
  else:
    x0 = jnp.argmax(probs, axis=-1).astype(jnp.int32)
    confidence = jnp.max(probs, axis=-1)
  if margin:
    top2 = jax.lax.top_k(probs, 2)[0]
    confidence = top2[..., 0] - top2[..., 1]
  if neg_entropy:
    confidence = jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
  return confidence, x0


@struct.dataclass
class DreamCarry:
  """tokens [B, S]; key; decode_step [B, G]. Block modes also: block, the index of the last block whose
  block-start step ran (scalar int32, −1 before the first); block_step, the steps taken in that block;
  cache, the `KVCache` (None without a cache)."""

  tokens: jax.Array
  key: jax.Array
  decode_step: jax.Array
  block: jax.Array | None = None
  block_step: jax.Array | None = None
  cache: KVCache | None = None


@dataclasses.dataclass(frozen=True)
class DreamFamily(driver.MaskedDiffusionFamily):
  """Dream's `diffusion_generate` (module docstring). infill: the prompt holds mask tokens, so the
  logits of the whole sequence are needed (else those of the generation region only)."""

  infill: bool

  name = "dream"
  runs_policies = True
  min_prompt_length = 1
  padding_attention = "outer"
  shift_positions = True

  def check(self, config: ModelConfig, intervention: Intervention) -> None:
    del intervention
    if config.logit_shift != 1:
      raise ValueError(f"Dream sampling reads shifted logits; config {config.name!r} has logit_shift=0 "
                       "(use dlm_jax.sampling.llada for unshifted models).")

  def init_carry(self, run, params, sequence, key, consts) -> DreamCarry:
    decode_step = jnp.full((sequence.shape[0], self.options.gen_length), -1, jnp.int32)
    return DreamCarry(tokens=sequence, key=key, decode_step=decode_step)

  def proposals(self, run, logits: jax.Array, key: jax.Array, alg: Alg = "maskgit_plus"):
    """`sample_tokens` with the options' temperature, top-p and top-k and alg's confidence (p(x0), the
    top1 − top2 margin for "topk_margin", the negative entropy for "entropy"): logits [B, W, V] ->
    (confidence [B, W] float32, x0 [B, W] int32)."""
    o = self.options
    return sample_tokens(logits, key, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                         margin=alg == "topk_margin", neg_entropy=alg == "entropy", per_row=run.row_keys)

  def step(self, run, params, consts: padding.PaddingLayout, carry: DreamCarry, istate, i, phase):
    o, mask_id, lp, shift = self.options, self.mask_id, run.prompt_length, run.config.logit_shift
    w0 = 0 if self.infill else lp
    x = carry.tokens
    key, sample_key, select_key = keys.split(carry.key, 3, run.row_keys)
    inputs = CallInputs(x, consts.positions, consts.valid, consts.valid, consts.bias, block_start=lp, block_step=i)
    result = run.caller(params, i, istate, inputs,
                        Readout(window=logit_shift.output_window(w0, run.total_length, shift)))
    logits = logit_shift.target_logits(result.logits, w0, shift)
    x_win = x[:, w0:]
    masked = x_win == mask_id
    fraction = jnp.asarray(dream_transfer_fractions(o.steps, o.eps))[i]
    confidence, x0 = self.proposals(run, logits, sample_key, o.alg)
    if o.alg == "origin":
      reveal = keys.uniform(select_key, masked.shape, jnp.float32, 0.0, 1.0, run.row_keys) < fraction
      x_win = jnp.where(masked & reveal, x0, x_win)
    else:
      k = dream_transfer_count(jnp.sum(masked), x.shape[0], fraction, i == o.steps - 1)
      full_confidence = jnp.where(masked, confidence, -jnp.inf)
      if o.alg_temp:
        gumbel = keys.gumbel(select_key, full_confidence.shape, jnp.float32, run.row_keys)
        full_confidence = jax.nn.log_softmax(full_confidence / o.alg_temp, axis=-1) + gumbel
      chosen = select_top_k(full_confidence, k)
      x_win = jnp.where(chosen, jnp.where(masked, x0, mask_id), x_win)
    new_x = x.at[:, w0:].set(x_win)
    decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], mask_id, i)
    carry = DreamCarry(tokens=new_x, key=key, decode_step=decode_step)
    return carry, result.state, result.outputs


@dataclasses.dataclass(frozen=True)
class DreamBlockwiseFamily(DreamFamily):
  """Fast-dLLM's Dream block modes (`dlm_jax.sampling.dream_blockwise`): the exact family's checks and
  proposals, its own phases, carry (current block, its steps, the KV cache), early finish and model calls."""

  name = "dream_blockwise"
  runs_policies = True
  can_finish_early = True

  def check_policy(self, name: str) -> None:
    """With a cache only the policies that compose with it (`blocks.check_policy_cache`)."""
    blocks.check_policy_cache(self.options.cache, name)

  def phases(self, run) -> tuple[driver.Phase, ...]:
    return dream_blockwise.phases(self.options)

  def n_blocks(self, run) -> int:
    return self.options.num_blocks

  def init_carry(self, run, params, sequence, key, consts) -> DreamCarry:
    return super().init_carry(run, params, sequence, key, consts).replace(
        block=jnp.int32(-1), block_step=jnp.int32(0), cache=dream_blockwise.init_cache(run, params, sequence.shape[0]))

  def finished(self, run, consts, carry: DreamCarry, i, phase):
    """Skip the call (`dream_blockwise.finished`: the block done, or the last block in the one-phase layout)."""
    return dream_blockwise.finished(self, run, carry, phase)

  def open_phase(self, run, params, consts: padding.PaddingLayout, carry: DreamCarry, istate, i, phase):
    """With per-block phases (the prefix cache): the block-start step of block `phase.arg` (the cache
    refresh)."""
    return dream_blockwise.open_block(self, run, params, consts, carry, istate, i, phase.arg)

  def step(self, run, params, consts: padding.PaddingLayout, carry: DreamCarry, istate, i, phase):
    return dream_blockwise.step(self, run, params, consts, carry, istate, i, phase)


@dataclasses.dataclass(frozen=True)
class DreamWindowFamily(DreamFamily):
  """Elastic-Cache's Dream decoding (`dlm_jax.sampling.dream_window`): one phase of at most G calls that ends when no
  row has a candidate left. eos_id: the EOS id of `DreamOptions.eos_truncation` (None without it)."""

  eos_id: int | None = None

  name = "dream_window"
  runs_policies = True
  can_finish_early = True

  @property
  def n_steps(self) -> int:
    return self.options.gen_length

  def n_blocks(self, run) -> int:
    return 1

  def finished(self, run, consts, carry: DreamCarry, i, phase):
    return dream_window.finished(self, run, carry)

  def step(self, run, params, consts: padding.PaddingLayout, carry: DreamCarry, istate, i, phase):
    return dream_window.step(self, run, params, consts, carry, istate, i)


@dataclasses.dataclass(frozen=True)
class DreamRuleFamily(llada_rules.RuleFamilyMixin, DreamFamily):
  """Dream under a decoding rule (`DreamOptions.rule`; `dlm_jax.sampling.llada_rules`, with Dream's shifted
  logits — WINO's verification copy and the cached calls' queries included — and `sample_tokens` proposals:
  temperature, top-p and top-k as the options say, where the rule takes them)."""

  name = "dream_rules"
  runs_policies = True
  can_finish_early = True
  dream_klass_default = True

  def check(self, config: ModelConfig, intervention: Intervention) -> None:
    super().check(config, intervention)
    llada_rules.check(self, config, intervention)

  def check_policy(self, name: str) -> None:
    llada_rules.check_policy(self, name)

  def constants(self, run, sequence, layout):
    return llada_rules.constants(self, super().constants(run, sequence, layout))

  def klass_ranking(self, logits) -> jax.Array | None:
    """KLASS's llada_klass on Dream: its fallback quota ranks by `sample_tokens`' p(x0) after top-p / top-k
    (temperature 0), as KLASS's Dream code (`dream_klass.py`) ranks its fallback; None (the gate's p(x0))
    without them. (Variant "dream_klass" ranks by `_proposals`' confidence, temperature included.)"""
    o = self.options
    if (o.top_p is None or o.top_p >= 1) and o.top_k is None:
      return None
    return sample_tokens(logits, None, temperature=0.0, top_p=o.top_p, top_k=o.top_k)[0]

  def _proposals(self, params, logits, uncond_logits, key, per_row: bool = False):
    """(x0, confidence p(x0)) [B, G] from Dream's `sample_tokens` (alg maskgit_plus)."""
    del params, uncond_logits
    o = self.options
    confidence, x0 = sample_tokens(logits, key, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                                   per_row=per_row)
    return x0, confidence


def _family(config: ModelConfig, options: DreamOptions, prompt) -> DreamFamily:
  """The exact family, the block one when the options set a block length, Elastic-Cache's window decoding
  (`DreamOptions.windowed`) or the decoding rules' one."""
  mask_id = config.mask_token_id if options.mask_token_id is None else options.mask_token_id
  if mask_id is None:
    raise ValueError("Dream sampling needs a mask token id: set ModelConfig.mask_token_id or options.mask_token_id.")
  infill = bool(np.any(np.asarray(prompt) == mask_id))
  if options.windowed:
    eos_id = config.eos_token_id if options.eos_token_id is None else options.eos_token_id
    if options.eos_truncation and eos_id is None:
      raise ValueError("eos_truncation needs an EOS id (config.eos_token_id or options.eos_token_id).")
    return DreamWindowFamily(options=options, mask_id=mask_id, infill=infill, eos_id=eos_id)
  family = DreamBlockwiseFamily if options.blockwise else DreamFamily
  if options.rule is not None:
    family = DreamRuleFamily
  return family(options=options, mask_id=mask_id, infill=infill)


diffusion_generate = driver.public_sampler(_family, DreamOptions(), """Dream masked-diffusion generation
(module docstring), one compiled program per shape.

Args:
  params: model parameters (a config with logit_shift=1).
  prompt: [B, Lp] int token ids, left-padded for batches (Lp >= 1).
  config: model config (static).
  options: `DreamOptions` (static).
  key: PRNG key; default key(0); or [B] keys, one per row (see `dlm_jax.sampling.driver.run_family`).
  prompt_mask: [B, Lp] 1 = real token, 0 = pad; None = no padding.
  setup: a `dlm_jax.sampling.run_setup.RunSetup` (statistics, intervention, hooks, attention path, loop, …);
    see `dlm_jax.sampling.driver.run_family` (old keywords: deprecated).

Returns:
  `Trace` with tokens [B, Lp + G], decode_step [B, G], nfe (= steps for the exact sampler; the model calls
  run in the block modes and Elastic-Cache's decoding), stats [max_steps, ...] (valid for the first nfe steps),
  top_sinks, active_rows, computed_queries.
""", public_name="diffusion_generate")
