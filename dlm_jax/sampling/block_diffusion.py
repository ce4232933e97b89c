"""Block diffusion with an exact KV cache (LLaDA2.x, SDAR, dInfer; `reference/decoding_modes.md` §6) on the
sampler driver, one compiled program.

Sequence. For a [B, Lp] prompt and G = `gen_length`, with L the block length, the sequence has
T = ⌈(Lp + G) / L⌉·L positions: the prompt at 0..Lp−1, then T − Lp ≥ G mask tokens. The generation is
extended to fill the last block, as in LLaDA2's `generate`, whose answer is cut back to the first G
generated tokens (`answers`). The blocks are those of the model's block-causal attention
(`ModelConfig.attention_block_size`, which must equal the block length): block k = [kL, (k + 1)L) on the
absolute grid from position 0, prompt included. The ⌊Lp/L⌋ blocks wholly inside the prompt are never
decoded; the first decoded block may hold the prompt's tail (not masks, never changed).

Model calls, `cache=True`:
  * prefill — the run's opening, when Lp ≥ L: the complete prompt blocks [0, ⌊Lp/L⌋·L) in one call,
    storing every layer's keys and values;
  * decoding steps of block [s, e): the block's queries only, RoPE positions s..e−1, cache offset s; they
    attend to the committed cache [0, s) and to the block's own fresh keys and values (written at [s, e));
    later blocks are unwritten and invisible under the block-causal mask;
  * commit — once the block holds no mask: one more call on the finished block, storing its keys and values
    (one extra model call per block; none after the last block, nor when every row has stopped). No block
    sees a later one, so committed keys and values are those of an uncached pass and never change: the cache
    is exact.
  These calls have fixed shapes (L queries at a traced cache offset s), so the run is one driver phase —
  the prefill as its opening, then at most `step_bound` decoding calls and a commit per block — with the
  current block in the carry, advanced at the end of the step that finishes it; it compiles one step body
  whatever the number of blocks (first call, tiny LLaDA, 8 prompt tokens, blocks of 8, best of 3 on a
  loaded 2-core Xeon: 4.4 s for 2 and for 8 decoded blocks, 5.2 s and 12.3 s with one phase per block).
`cache=False` (LLaDA2's Hugging Face `generate`): every step runs the window [0, e) from scratch with the
block-causal mask and reads the block's logits. It goes through the forward's cache path on a fresh buffer
of T slots, so that keys (statistics, interventions) address all T positions in both modes; nothing is
carried between steps. The window's length changes with the block, so each block is a driver phase of its
own (static shapes; compile time grows with the number of blocks). Running the whole sequence [0, T) under
the block-causal mask instead would decode the same tokens (later keys are invisible) at up to T/e times
the compute, but would change the statistics (the later queries' incoming attention, the value norms of
later positions), so it is not done. The two modes give the same tokens (`tests/test_block_diffusion.py`).

Rule per step; candidates = the block's masked positions, each with a proposal x0 and its probability p:
  * "llada2" (LLaDA2.0's sampler, SDAR's `low_confidence_dynamic`): step j of a block has the quota q_j of
    splitting the block length L (not the mask count) over n = min(steps, gen_length) steps (LLaDA2's cap
    with minimal_topk 1): ⌊L/n⌋, plus one for the first L mod n steps. H = candidates with p > τ (strict);
    if `|H|` ≥ q_j, H is committed, else the min(q_j, #candidates) most confident candidates
    (`parallel.quota_threshold_transfer`; threshold None = the quota alone). A block ends within n steps.
  * "fast_dllm": Fast-dLLM's threshold rule (`parallel.threshold_transfer`: p ≥ τ, and always the most
    confident candidate); a block takes the steps it needs, at most L (`steps` is unused).
Proposals (LLaDA2's `_sample_with_temperature_topk_topp`, in float32): the argmax at temperature 0, p from
the softmax of the logits; otherwise the logits are divided by the temperature, filtered by top-k then top-p
(`selection.filter_top_k`, `filter_top_p`), x0 is a categorical draw and p its filtered probability. Ties
go to the lowest index. A block whose most confident proposal is the mask id itself can stay partly masked
after its last step; it is committed as it is.

Token editing (LLaDA2.1, `editing_threshold` τ_edit; decoding_modes.md §6): at each call of block [s, e) the
set Δ of the block's positions that are neither masks nor prompt, whose proposal differs from their token
and has p > τ_edit, takes its proposals together with the masks the "llada2" rule commits (Γ; with
LLaDA2.1's num_to_transfer = 1 that is `steps` = L). Once the block holds no mask, a row keeps calling it
while its previous call edited, at most `max_post_steps` calls made on the mask-free block; then it is done
(and committed with the cache). Edits do not change `decode_step` (the step a position was unmasked).
Multi-block editing (revisiting earlier blocks, LLaDA2.1's MBE) is not in the reference samplers and is not
implemented; LLaDA2.1's S / Q mode thresholds are unverified (set them yourself).

EOS (`eos_stop`, LLaDA2.0's behaviour): after each block, a row whose generated part holds the EOS id stops
(it waits; its later blocks stay masks, decode_step −1), and the run ends when every row has stopped.
`answers` gives LLaDA2's return value: the first G generated tokens up to and including the first EOS.

Batches. Rows move from block to block together: a row whose block is done, or that has stopped, waits —
unchanged, `Trace.active_rows` False, its key and its intervention state not advanced
(`Intervention.keep_rows`; a commit call updates every row's) — while the others finish, so its tokens and
`row_nfe` are those it gets alone (at temperature > 0 with [B] keys too). The prefill and the commits
decode no row, so their `active_rows` are all False (a step with no active row is a cache call): they
count in `nfe`, not in `row_nfe`. Left padding (`prompt_mask`): pads keep their place on the block grid
(blocks are physical positions) but are no keys for any query and no queries of the statistics, and RoPE
positions are logical ("key" padding with shifted positions, `dlm_jax.sampling.padding`). A row in a padded
batch therefore gets its results alone when its padding is a multiple of L — e.g. when every prompt is
left-padded to a multiple of L (dllm's BD3LM layout); another padding moves its real tokens on the grid.

Statistics: the incoming attention of the step's computed queries (`Trace.computed_queries`: the prompt
blocks, the block, or [0, e) without cache) over all T keys, the cached ones included; keys after the block
receive nothing. A cached step of block k plus the prefill's and the commits' statistics of the blocks
before k equals the uncached step's.

Compute policies (`RunSetup.policy`): `sparse_dllm` with the cache (ours, no official code for LLaDA2;
docs/guides/compute_policies.md, "sparse_dllm"). The family keeps its exact cache and tells the policy each call's
block (`CallInputs.block_start`, `block_step`: the calls the block has had, −1 at the prefill and the commits);
the model caller runs a call the policy makes full as above, else the block's queries over each layer's kept keys
of the cached prefix [0, s) and their own (`policy_call.family_cache_forward`). A block's calls 0 and 1 are full
(call 1 scores the keys), its later calls read the kept keys; the prefill and the commits read every key (they
write the cache, which so stays exact). Every other policy, `cache=False` and hooks under a policy are refused in
one line.

Interventions act at every model call, prefill and commits included (`MaskPreviousSinks` masks at each call
the top sinks of the previous call, whichever kind it was). Keys and values committed under an
intervention's bias keep it, while the uncached mode recomputes them under each step's bias: the two modes
agree for interventions whose bias does not change between calls (e.g. the extra sink token at the front).
`SinkToken(position="end")` is refused: the last position lies in the last block, which no other block sees.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.instrument import interventions
from dlm_jax.config import ModelConfig
from dlm_jax.model import KVCache
from dlm_jax.sampling import blocks, driver, keys, padding
from dlm_jax.sampling.call_inputs import CacheCall, CallInputs, Readout
from dlm_jax.sampling.parallel import quota_threshold_transfer, threshold_transfer
from dlm_jax.sampling.selection import filter_top_k, filter_top_p, update_decode_step
from dlm_jax.sampling.trace import Trace

Transfer = Literal["llada2", "fast_dllm"]


def _positive_int(value) -> bool:
  return not isinstance(value, bool) and isinstance(value, int) and value > 0


@dataclasses.dataclass(frozen=True)
class BlockDiffusionOptions:
  """Static knobs of block diffusion (defaults: LLaDA2.0's `generate`, decoding_modes.md §6).

  Attributes:
    gen_length: G, the tokens asked for (LLaDA2 default 2048); the sequence extends the generation to the end
      of the last block (module docstring).
    block_length: L, positions per block (32); must equal the model's `attention_block_size`.
    steps: steps per block for the "llada2" rule (32), capped at gen_length.
    threshold: τ (0.95); None = the quota alone ("llada2" only).
    transfer: "llada2" (quota and strict threshold) or "fast_dllm" (p ≥ τ, most confident forced).
    temperature: 0 = argmax; > 0 samples.
    top_k, top_p: filters when sampling (None = off).
    cache: True = the exact KV cache (prefill, block steps, commits); False = every step recomputes [0, e).
    editing_threshold: None (LLaDA2.0) or τ_edit of LLaDA2.1's token editing ("llada2" only): at every call
      a decoded, non-prompt position of the block whose proposal differs from its token with p > τ_edit
      (strict) takes the proposal, next to the masks the rule commits; a block whose masks are all decoded
      takes further calls (post steps) while the previous call edited, at most `max_post_steps` of them
      (module docstring). LLaDA2.1's default is 0.9 (decoding_modes.md §6).
    max_post_steps: calls on a mask-free block with editing (LLaDA2.1: 16).
    eos_stop: stop a row after the block in which its generated part first holds the EOS id.
    mask_token_id, eos_token_id: override the config's ids.
  """

  gen_length: int = 2048
  block_length: int = 32
  steps: int = 32
  threshold: float | None = 0.95
  transfer: Transfer = "llada2"
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  cache: bool = True
  editing_threshold: float | None = None
  max_post_steps: int = 16
  eos_stop: bool = True
  mask_token_id: int | None = None
  eos_token_id: int | None = None

  def __post_init__(self):
    for name in ("gen_length", "block_length", "steps"):
      if not _positive_int(getattr(self, name)):
        raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}.")
    if self.transfer not in ("llada2", "fast_dllm"):
      raise ValueError(f"transfer must be 'llada2' or 'fast_dllm', got {self.transfer!r}.")
    if self.threshold is None and self.transfer == "fast_dllm":
      raise ValueError("transfer='fast_dllm' needs a threshold (Fast-dLLM commits every proposal with p >= τ).")
    if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
      raise ValueError(f"threshold must be in [0, 1] (a probability) or None, got {self.threshold!r}.")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
    if self.top_k is not None and not _positive_int(self.top_k):
      raise ValueError(f"top_k must be None or a positive integer, got {self.top_k!r}.")
    if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}.")
    if self.editing_threshold is not None:
      if not 0.0 <= self.editing_threshold <= 1.0:
        raise ValueError(f"editing_threshold must be None or in [0, 1] (a probability), got {self.editing_threshold!r}.")
      if self.transfer != "llada2":
        raise ValueError("editing_threshold (LLaDA2.1's token editing) goes with transfer='llada2'.")
    if isinstance(self.max_post_steps, bool) or not isinstance(self.max_post_steps, int) or self.max_post_steps < 0:
      raise ValueError(f"max_post_steps must be an integer >= 0, got {self.max_post_steps!r}.")
    if not isinstance(self.cache, bool) or not isinstance(self.eos_stop, bool):
      raise ValueError(f"cache and eos_stop must be bools, got {self.cache!r} and {self.eos_stop!r}.")

  @property
  def steps_per_block(self) -> int:
    """n: the "llada2" steps of a block, min(steps, gen_length)."""
    return min(self.steps, self.gen_length)

  @property
  def step_bound(self) -> int:
    """Decoding steps a block may take: n ("llada2"; n + max_post_steps with editing) or L ("fast_dllm")."""
    if self.transfer != "llada2":
      return self.block_length
    return self.steps_per_block + (self.max_post_steps if self.editing_threshold is not None else 0)

  @property
  def quotas(self) -> tuple[int, ...]:
    """q_j, j < n: the block length split over the steps, the remainder to the first steps."""
    n, length = self.steps_per_block, self.block_length
    return tuple(length // n + int(j < length % n) for j in range(n))


@struct.dataclass
class BlockDiffusionCarry:
  """tokens [B, T]; key; decode_step [B, T − Lp]; block: scalar int32, the block being decoded (the first
  decoded block before any call; with the cache a step moves it on once the block is done, without it each
  step sets it to its phase's block); block_step: calls made in that block; committed: blocks whose keys and
  values the cache holds (the cache is exact on [0, committed·L)); edited [B] bool: the row's previous call
  of the block edited a token, post_steps [B] int32: its calls on the block once mask-free (both for
  editing; reset with the block); cache: the `KVCache` of T positions (cache=True) or None."""

  tokens: jax.Array
  key: jax.Array
  decode_step: jax.Array
  block: jax.Array
  block_step: jax.Array
  committed: jax.Array
  edited: jax.Array
  post_steps: jax.Array
  cache: KVCache | None = None


@dataclasses.dataclass(frozen=True)
class BlockDiffusionFamily(driver.MaskedDiffusionFamily):
  """Block diffusion (module docstring) with resolved ids; gen_width = T − Lp, the generated positions."""

  eos_id: int | None
  gen_width: int

  name = "block_diffusion"
  padding_attention = "key"
  shift_positions = True
  can_finish_early = True
  runs_policies = True

  @property
  def policy_cache(self) -> str:
    """"block" with the cache (the family keeps it; a policy takes key subsets of it), else "none"."""
    return "block" if self.options.cache else "none"

  def check_policy(self, name: str) -> None:
    """Only a key-subset policy of the cache (`blocks.CACHE_POLICIES`: sparse_dllm), with the cache."""
    if name not in blocks.CACHE_POLICIES or not self.options.cache:
      raise ValueError(f"policy {name!r} does not run with block diffusion (cache={self.options.cache}): its cached "
                       f"calls take a key subset of the exact cache only; use {', '.join(blocks.CACHE_POLICIES)} "
                       "with cache=True.")

  @property
  def gen_length(self) -> int:
    return self.gen_width

  def check(self, config: ModelConfig, intervention: interventions.Intervention) -> None:
    interventions.refuse_end_sink_token(intervention, "block diffusion", "the last sequence position lies in the last "
                                        "block, which no earlier block sees under block-causal attention")
    length = self.options.block_length
    if config.attention_block_size is None:
      raise ValueError(f"Block diffusion needs a block-causal model: config {config.name!r} has "
                       f"attention_block_size=None; use config.replace(attention_block_size={length}).")
    if config.attention_block_size != length:
      raise ValueError(f"Block diffusion decodes the blocks of the model's attention: config {config.name!r} has "
                       f"attention_block_size={config.attention_block_size} but block_length={length}; make "
                       "them equal.")
    if config.logit_shift:
      raise ValueError(f"Block diffusion reads each position's own logit (logit_shift=0, as LLaDA2); config "
                       f"{config.name!r} has logit_shift={config.logit_shift}.")

  def _blocks(self, run) -> tuple[int, int]:
    """(first decoded block, last block)."""
    length = self.options.block_length
    return run.prompt_length // length, run.total_length // length - 1

  def phases(self, run) -> tuple[driver.Phase, ...]:
    """With the cache: one phase over the decoded blocks (the block index in the carry), opened by the prefill
    when the prompt holds a complete block, bounded by step_bound decoding calls per block and a commit per
    block but the last. Without it: one phase of step_bound steps per decoded block (the window [0, e)
    changes with the block; `phase.arg` is the block)."""
    o = self.options
    first, last = self._blocks(run)
    if o.cache:
      return (driver.Phase(steps=(last - first + 1) * (o.step_bound + 1) - 1, opening=first > 0),)
    return tuple(driver.Phase(arg=k, steps=o.step_bound) for k in range(first, last + 1))

  def block_index(self, run, before, after, i, phase_index):
    """The block the step worked on: with the cache the carry's before the step (a commit call, which ends a
    block, moves the carry on to the next one); without it the phase's, which the step sets."""
    del i, phase_index
    return jnp.asarray(before.block if self.options.cache else after.block, jnp.int32)

  def n_blocks(self, run) -> int:
    first, last = self._blocks(run)
    return last - first + 1

  def init_carry(self, run, params, sequence, key, consts) -> BlockDiffusionCarry:
    b = sequence.shape[0]
    cache = None
    if self.options.cache:
      cache = KVCache.zeros(run.config, b, run.total_length, params["embed"]["embedding"].dtype)
    zero = jnp.zeros((), jnp.int32)
    return BlockDiffusionCarry(tokens=sequence, key=key, decode_step=jnp.full((b, self.gen_width), -1, jnp.int32),
                               block=zero + self._blocks(run)[0], block_step=zero, committed=zero,
                               edited=jnp.zeros((b,), bool), post_steps=jnp.zeros((b,), jnp.int32), cache=cache)

  def _stopped(self, run, tokens: jax.Array, end: int) -> jax.Array:
    """[B] bool: the row's generated positions before `end` hold the EOS id (with eos_stop)."""
    if not self.options.eos_stop:
      return jnp.zeros(tokens.shape[:1], bool)
    position = jnp.arange(tokens.shape[1])
    generated = (position >= run.prompt_length) & (position < end)
    return jnp.any((tokens == self.eos_id) & generated[None, :], axis=1)

  @staticmethod
  def _block(carry: BlockDiffusionCarry, phase: driver.Phase):
    """The block of the next call: the phase's (static, without the cache) or the carry's (traced)."""
    return carry.block if phase.arg is None else phase.arg

  def _progress(self, run, carry: BlockDiffusionCarry, k) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(block_step, decoding [B]: the rows that decode at the next call of block k, commit: scalar bool, the
    next call is block k's commit). k: static int or traced scalar. With editing a mask-free block goes on
    while its previous call edited, for at most max_post_steps calls."""
    o = self.options
    s, e = k * o.block_length, (k + 1) * o.block_length
    same = carry.block == k
    block_step = jnp.where(same, carry.block_step, 0)
    masked = jnp.any(_rows(carry.tokens, s, o.block_length) == self.mask_id, axis=1)
    if o.editing_threshold is not None:
      post = jnp.where(same, carry.post_steps, 0)
      masked = masked | (same & carry.edited & (post < o.max_post_steps))
    decoding = masked & ~self._stopped(run, carry.tokens, s) & (block_step < o.step_bound)
    commit = jnp.zeros((), bool)
    if o.cache:
      commit = ((k < self._blocks(run)[1]) & ~jnp.any(decoding) & (carry.committed <= k)
                & ~jnp.all(self._stopped(run, carry.tokens, e)))
    return block_step, decoding, commit

  def finished(self, run, consts, carry: BlockDiffusionCarry, i, phase) -> jax.Array:
    """No row decodes the block any more and its commit (if any) is done. With the cache the carry's block
    moves on after each block but the last, so this is the end of the run (the last block done, or every row
    stopped)."""
    _, decoding, commit = self._progress(run, carry, self._block(carry, phase))
    return ~jnp.any(decoding) & ~commit

  def open_phase(self, run, params, layout: padding.PaddingLayout, carry: BlockDiffusionCarry, istate, i, phase):
    """The prefill: the prompt's complete blocks [0, n) in one call, storing their keys and values."""
    n = self._blocks(run)[0] * self.options.block_length
    x = carry.tokens
    inputs = CallInputs(x[:, :n], layout.positions[:, :n], layout.valid[:, :n],
                        layout.valid & (jnp.arange(run.total_length) < n)[None, :],
                        padding.query_rows(layout.bias, 0, n), block_start=jnp.zeros((), jnp.int32),
                        block_step=jnp.full((), -1, jnp.int32))
    result = run.caller(params, i, istate, inputs, Readout(window=(n - 1, n)), CacheCall(carry.cache, 0, x))
    carry = carry.replace(cache=result.cache, committed=jnp.asarray(n // self.options.block_length, jnp.int32))
    outputs = result.outputs.replace(active=jnp.zeros(x.shape[:1], bool), queries=jnp.array([0, n], jnp.int32))
    return carry, result.state, outputs

  def _proposals(self, logits: jax.Array, key: jax.Array, per_row: bool) -> tuple[jax.Array, jax.Array]:
    """(x0 [B, L] int32, p(x0) [B, L] float32) from the block's logits [B, L, V]."""
    o = self.options
    if o.temperature == 0:
      x0 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      probs = jax.nn.softmax(logits, axis=-1)
    else:
      scaled = logits / o.temperature
      if o.top_k is not None:
        scaled = filter_top_k(scaled, o.top_k)
      if o.top_p is not None and o.top_p < 1:
        scaled = filter_top_p(scaled, o.top_p)
      probs = jax.nn.softmax(scaled, axis=-1)
      x0 = keys.categorical(key, scaled, per_row).astype(jnp.int32)
    return x0, jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]

  def _transfer(self, confidence: jax.Array, candidates: jax.Array, block_step: jax.Array) -> jax.Array:
    o = self.options
    if o.transfer == "fast_dllm":
      return threshold_transfer(confidence, candidates, o.threshold)
    quotas = jnp.asarray(o.quotas, jnp.int32)
    return quota_threshold_transfer(confidence, candidates, o.threshold,
                                    quotas[jnp.minimum(block_step, len(o.quotas) - 1)])

  def step(self, run, params, layout: padding.PaddingLayout, carry: BlockDiffusionCarry, istate, i, phase):
    """A decoding call of block k (the carry's with the cache, `phase.arg` without) for the rows that still
    decode it, or (cache, no such row) its commit; with the cache, the carry then moves to block k + 1 when
    block k is done and is not the last. Returns (carry, istate, StepOutput)."""
    o, lp, total, length = self.options, run.prompt_length, run.total_length, self.options.block_length
    k = self._block(carry, phase)
    s, e = k * length, (k + 1) * length
    x = carry.tokens
    block_step, decoding, _ = self._progress(run, carry, k)
    if o.cache:
      start, queries, window, cache = s, length, (0, length), carry.cache
    else:
      start, queries, window = 0, e, (s, e)
      cache = KVCache.zeros(run.config, x.shape[0], total, params["embed"]["embedding"].dtype)
    inputs = CallInputs(_rows(x, start, queries), _rows(layout.positions, start, queries),
                        _rows(layout.valid, start, queries), layout.valid & (jnp.arange(total) < e)[None, :],
                        padding.query_rows(layout.bias, start, queries), block_start=jnp.asarray(s, jnp.int32),
                        block_step=jnp.where(jnp.any(decoding), block_step, -1).astype(jnp.int32))
    result = run.caller(params, i, istate, inputs, Readout(window=window), CacheCall(cache, start, x))
    key, step_key = keys.split(carry.key, 2, run.row_keys)
    x0, confidence = self._proposals(result.logits, step_key, run.row_keys)
    block_tokens = _rows(x, s, length)
    candidates = (block_tokens == self.mask_id) & decoding[:, None]
    chosen = self._transfer(confidence, candidates, block_step)
    edited, post_steps = carry.edited, carry.post_steps
    if o.editing_threshold is not None:
      position = s + jnp.arange(length)
      edits = ((block_tokens != self.mask_id) & (position >= lp)[None, :] & (x0 != block_tokens)
               & (confidence > o.editing_threshold) & decoding[:, None])
      same = carry.block == k
      mask_free = ~jnp.any(block_tokens == self.mask_id, axis=1)
      post_steps = (jnp.where(same, post_steps, 0) + (decoding & mask_free)).astype(jnp.int32)
      edited = jnp.where(decoding, jnp.any(edits, axis=1), same & edited)
      chosen = chosen | edits
    new_x = jax.lax.dynamic_update_slice_in_dim(x, jnp.where(chosen, x0, block_tokens), s, axis=1)
    decode_step = update_decode_step(carry.decode_step, x[:, lp:], new_x[:, lp:], self.mask_id, i)
    key = keys.keep_rows(decoding if run.row_keys else jnp.any(decoding), key, carry.key)
    committed = carry.committed
    if o.cache:
      committed = jnp.where(jnp.any(decoding), committed, k + 1)
    carry = carry.replace(tokens=new_x, key=key, decode_step=decode_step, block=jnp.asarray(k, jnp.int32),
                          block_step=block_step + 1, committed=committed, edited=edited, post_steps=post_steps,
                          cache=result.cache if o.cache else None)
    if phase.arg is None:
      carry = self._advance(run, carry, k)
    outputs = result.outputs.replace(active=decoding, queries=jnp.stack([jnp.asarray(start, jnp.int32),
                                                                         jnp.asarray(e, jnp.int32)]))
    return carry, result.state, outputs

  def _advance(self, run, carry: BlockDiffusionCarry, k) -> BlockDiffusionCarry:
    """The carry after a call of block k (traced) in the one-phase layout: at block k + 1, step 0, when no row
    decodes block k any more, its commit is done and it is not the last block; else unchanged."""
    _, decoding, commit = self._progress(run, carry, k)
    over = ~jnp.any(decoding) & ~commit & (k < self._blocks(run)[1])
    return carry.replace(block=k + over.astype(jnp.int32), block_step=jnp.where(over, 0, carry.block_step),
                         edited=carry.edited & ~over, post_steps=jnp.where(over, 0, carry.post_steps))


def _rows(array: jax.Array, start, length: int) -> jax.Array:
  """array[:, start:start + length] of a [B, T] array; start: int or traced scalar."""
  return jax.lax.dynamic_slice_in_dim(array, start, length, axis=1)


def _family(config: ModelConfig, options: BlockDiffusionOptions, prompt) -> BlockDiffusionFamily:
  mask_id = config.mask_token_id if options.mask_token_id is None else options.mask_token_id
  eos_id = config.eos_token_id if options.eos_token_id is None else options.eos_token_id
  if mask_id is None:
    raise ValueError("Block diffusion needs a mask token id: set ModelConfig.mask_token_id or options.mask_token_id.")
  if options.eos_stop and eos_id is None:
    raise ValueError("eos_stop needs an EOS id: set ModelConfig.eos_token_id or options.eos_token_id, or "
                     "eos_stop=False.")
  prompt_length = np.shape(prompt)[-1] if np.ndim(prompt) else 0
  length = options.block_length
  total = -(-(prompt_length + options.gen_length) // length) * length
  return BlockDiffusionFamily(options=options, mask_id=mask_id, eos_id=eos_id, gen_width=total - prompt_length)


def answers(trace: Trace, gen_length: int, eos_id: int) -> list[np.ndarray]:
  """LLaDA2's answers: per row, the first `gen_length` generated tokens up to and including the first EOS id
  (all `gen_length` when there is none). Returns B int32 arrays (host)."""
  rows = []
  for row in np.asarray(trace.generated)[:, :gen_length]:
    eos = np.flatnonzero(row == eos_id)
    rows.append(row[:eos[0] + 1] if eos.size else row)
  return rows


generate = driver.public_sampler(_family, BlockDiffusionOptions(), """Block diffusion with an exact KV cache
(LLaDA2.x / SDAR / dInfer; module docstring), one compiled program per shape.

Args:
  params: model parameters of a block-causal config (`attention_block_size` = options.block_length).
  prompt: [B, Lp] int token ids, left-padded for batches.
  config: model config (static).
  options: `BlockDiffusionOptions` (static).
  key: PRNG key (temperature > 0); default key(0); or [B] keys, one per row.
  prompt_mask, setup: see `dlm_jax.sampling.driver.run_family` (`setup`: a `RunSetup`; old keywords such
    as stats_spec= are deprecated; `setup.policy`: `sparse_dllm` with cache=True, module docstring).

Returns:
  `Trace` with tokens [B, T] (T = ⌈(Lp + G)/L⌉·L), decode_step [B, T − Lp], nfe (prefill and commits
  included), active_rows (all False at the prefill and the commits), computed_queries, stats [max_steps, ...]
  over the T keys, top_sinks. `answers(trace, G, eos_id)` gives the answers as LLaDA2 returns them.
""")
