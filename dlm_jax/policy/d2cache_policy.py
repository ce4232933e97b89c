"""d2Cache as a compute policy: step 0 computes every position; every later step recomputes only the positions
d2Cache's rule selected at the end of the previous step (`dlm_jax.policy.d2cache.query_mask`, then the batch
top-up), each reading all S keys from the policy's KV cache (the other positions' keys and values as last
computed, Kamichanw/d2Cache `src/cache/d2cache.py`).

Samplers (`FAMILIES`). The official runs go through Research dLLM's `vanilla_generate` / `generate_step`
(`src/generation/vanilla.py`): LLaDA's blocks and per-step quota, then one of three transfer rules, each run
here by the sampler that is that loop: the quota's most confident masks (generation.sigma unset: LLaDA / MMaDA's
exact sampler, "llada"); the quota's best by confidence × certainty density (generation.sigma > 0, the published
pairing: the certainty_prior decoding rule, "llada_rules" / "dream_rules"); `confidence_unmasking`'s threshold
or factor (generation.threshold / factor: "llada_blockwise" without a cache). Its threshold rule (every mask
with p >= τ, else the step's quota) is Fast-dLLM's (p >= τ, and the best one) when the quota is one token, so
d2cache needs steps per block == block_length there (the official scripts run steps = gen_length); its factor
rule is `factor_rule="research_dllm"` (`dlm_jax.sampling.parallel`; the other variants run, but are not that
loop). Dream runs through the same loop with its logits shifted (`prepare_logits_for_generation`: position i's
prediction is the output at i − 1), not through Dream's own `diffusion_generate`: our exact Dream sampler (its
timestep quota int(M(1 − s/t)), no blocks, alg "origin" revealing at random) can commit positions the query
set did not compute, and Fast-dLLM's Dream block modes commit position s from the output at s − 1 at each block
start, which the query set need not hold — both refused; on Dream d2cache runs under the certainty_prior rule
("dream_rules", which is that loop). The shift reaches the rule (`query_mask(shifted=True)`: the position
before each selected mask, the last prompt position set to whether generated position 0 was selected) and the
confidence (below).

Timing. The official code decides at the end of step t (`on_step_end`, after the step's tokens are written) and
tops the rows up at the start of step t + 1 (`model_forward`). Here the model caller runs `update` right after
the forward of step t, before the sampler writes its tokens, so the decision is taken in `decide` of step
t + 1, whose context holds the tokens after step t: the positions decoded at step t are those unresolved at
step t (kept in the state) that no longer are. A position that "transfers" the mask id itself (its argmax is
the mask token) stays masked and is not seen as decoded here; the official code recomputes it at the next
step. The step's own block (`block_mask`) is that of step t, as in `on_step_end`: the sampler's
`CallContext.block_start`, kept in the state (with threshold or factor decoding a block takes a variable number
of steps).

Rows. The official arrays hold the rows still generating (`active_seq_mask`: rows with a masked position in
the step's block); the other rows run nothing and keep their cache, query set, importance and scores. Here
such a row gets an empty query set (it computes and writes nothing) and keeps its state. With the exact
sampler and the certainty prior every row generates at every step (each step transfers at least one token of
its block), so this matters only with masks in the prompt; with threshold or factor decoding a row whose block
is done waits for the others, as in the official loop.

Confidence. The official confidence cache is the sampler's confidence at step 0 (max softmax probability at
temperature 0), never updated (`frozen_confidence`). `update` reads the largest softmax probability of the
call's logits (`ForwardOutput.max_probability`, computed by the model caller from the full call's logits only,
or from every call's computed rows with frozen_confidence=False): at temperature 0 and without the LLaDA
options' EOS knobs (`logits_eos_inf`, `confidence_eos_eot_inf`) it is the sampler's p(x0). At temperature > 0
the official sampler keeps p(x0) of the sampled token under softmax(logits / T); here the cache holds the
largest probability of softmax(logits) (the temperature-0 confidence), a documented difference. Likewise with
Dream's top_p / top_k (the official Dream config sets top_p 0.9): the official cache holds p(x0) renormalised
over the kept tokens, this one softmax(logits)'s largest probability (the sampler itself ranks by the
renormalised one); the runs equal the official ones with top_p and top_k unset. On Dream the confidence of
generated position i is read from the output at i − 1, and frozen_confidence=False updates it where that output
was computed. The full call reads the probability at all S positions even when its readout is the block's
logits (threshold and factor decoding; `policy_forward`).

Zero-filled logits. Positions a step does not compute get zero logits (`policy_forward`); LLaDA's sampler then
proposes token 0 there with confidence 1/V (Dream: where the output before is not computed; the certainty prior
scales it by the density) and keeps them as commit candidates, as the official sampler does
(`generate_step`'s `transfer_index_mask[can_generate].logical_and_(valid_mask)` acts on a copy). Ranked by
confidence they lose to any computed masked position whose logits are not uniform (its largest probability is
at least 1/V; under the certainty prior the density can reverse that, in both loops alike) and tie among
themselves; our sampler breaks ties by the lowest position, torch.topk's order among equal values is
UNVERIFIED.

Static shapes. The official query count varies per step. The decision's queries are [B, n] with n = S (or
`query_budget`), padded with S, and `buckets` are n and its halves (`query_buckets` sizes): the caller runs the
smallest that holds the step's largest row count, so the compute follows the count and every step is exact.
With `query_budget` < S a step whose set has more positions drops its highest ones and is not the official
step; `Trace.policy_record` says, per step and row, the official count, whether it overflowed and the rows the
call ran, which `call_flops` charges. Batch-invariant runs take each row's bucket from its own count
(`Decision.row_buckets`, set by `ModelCaller`: a row's last bits change with the row count, so the batch's bucket
would tie it to its neighbours), the forward switching per row inside the row-by-row map
(`dlm_jax.model.query_buckets`).

The rollout reads the statistic "attention_rows" ([L, B, S, S] in sequence coordinates: S×S per layer, as the
official S×S rollout matrices; zeros at rows a step did not compute) and keeps only the importance [B, S].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.stats import ForwardOutput, StatsSpec
from dlm_jax.model import query_buckets
from dlm_jax.policy import cost, d2cache
from dlm_jax.policy.base import ComputePolicy, Decision

FAMILIES = ("llada", "llada_rules", "llada_blockwise", "dream_rules")
"""The samplers d2cache runs with, each as the official loop (Research dLLM's `vanilla_generate`) runs it: LLaDA
and MMaDA's exact sampler ("llada": generation.sigma unset), LLaDA / MMaDA and Dream under the certainty-prior
rule ("llada_rules", "dream_rules": generation.sigma > 0, the published pairing), LLaDA / MMaDA's threshold or
factor decoding without a cache ("llada_blockwise": generation.threshold / factor)."""

RULES = ("certainty_prior",)
"""The decoding rules d2cache runs with (`dlm_jax.sampling.decoding_rules`): d2Cache's own certainty prior."""


@struct.dataclass
class D2CacheState:
  """conf: [B, G] float32, the confidence cache (step 0's confidence; -inf at positions not masked then);
  importance: [B, S] float32, the rollout importance of the last call that computed the row; density: [B, G]
  float32, the last certainty scores (with the block bonus; `top_up` reads them); queries: [B, S] bool, the
  last decided query set (before the top-up, kept for rows that do not generate); was_unresolved: [B, S] bool,
  the positions unresolved at the last call; count: [B] int32, the official query count of the last call
  (after the top-up; S at a full call); overflow: [B] bool, that count did not fit `query_budget`; rows: [B]
  int32, the query rows the last call ran (its bucket, padding included; S at a full call); block: [B] int32,
  the first generated position of the last call's block (the sampler's `CallContext.block_start` − gen_start)."""

  conf: jax.Array
  importance: jax.Array
  density: jax.Array
  queries: jax.Array
  was_unresolved: jax.Array
  count: jax.Array
  overflow: jax.Array
  rows: jax.Array
  block: jax.Array


@dataclasses.dataclass(frozen=True)
class D2Cache(d2cache.D2CacheSettings, ComputePolicy):
  """d2Cache (module docstring) with the settings of `d2cache.D2CacheSettings` (published defaults, quirk
  flags) and query_buckets: how many static row counts a step may run at (the largest, S or query_budget, and
  its successive halves; 1 runs every step at the largest, which computes as much as a full call)."""

  query_buckets: int = 4

  def check_knobs(self) -> None:
    d2cache.D2CacheSettings.check(self)
    if isinstance(self.query_buckets, bool) or not isinstance(self.query_buckets, int) or self.query_buckets < 1:
      raise ValueError(f"d2cache query_buckets must be an int >= 1, got {self.query_buckets!r}.")

  def check(self, config: ModelConfig | None = None, family_name: str | None = None) -> None:
    """The knobs (the settings' check, also run at construction) and, for a run, the family and layout."""
    self.check_knobs()
    del config
    if family_name in ("dream", "dream_blockwise"):
      raise ValueError(f"policy d2cache runs on Dream through Research dLLM's loop, as the official code: set "
                       f"decoding rule certainty_prior (--decoding=certainty_prior), not Dream's own sampler "
                       f"({family_name}).")
    if family_name is not None and family_name not in FAMILIES:
      raise ValueError(f"policy d2cache runs with the {', '.join(FAMILIES)} samplers (exact, certainty prior, "
                       f"threshold or factor decoding), not {family_name}.")
    layout = self.layout
    if layout is None:
      return
    if family_name in ("llada_rules", "dream_rules") and layout.decoding_rule not in RULES:
      raise ValueError(f"policy d2cache runs with decoding rule {', '.join(RULES)} (d2Cache's own decoding), not "
                       f"{layout.decoding_rule}.")
    if layout.decoding_window is not None or layout.eos_cut_id is not None:
      raise ValueError("policy d2cache does not run with a decoding window or EOS truncation (Elastic-Cache's "
                       "decoding); leave window and eos_truncation unset.")
    if family_name == "llada_blockwise" and layout.steps_per_block != layout.block_length:
      raise ValueError(f"policy d2cache with threshold or factor decoding runs the official loop, whose per-step "
                       f"quota (taken when too few tokens pass) is one token: needs steps per block == block_length "
                       f"{layout.block_length}, got {layout.steps_per_block} steps per block.")
    if layout.steps_per_block > layout.block_length:
      raise ValueError(f"policy d2cache needs every step to decode a token (steps per block <= block_length "
                       f"{layout.block_length}), got {layout.steps_per_block} steps per block.")
    if self.query_budget is not None and self.query_budget > layout.seq_len:
      raise ValueError(f"d2cache query_budget={self.query_budget} is more than the sequence's "
                       f"{layout.seq_len} positions.")

  @property
  def reads_max_probability(self) -> str:
    return "full" if self.frozen_confidence else "every"

  @property
  def buckets(self) -> tuple[int, ...]:
    """The static query-row counts a step runs at: the largest (S or query_budget) and its halves."""
    largest = self.layout.seq_len if self.query_budget is None else self.query_budget
    return query_buckets.halvings(largest, self.query_buckets)

  def required_stats(self, config: ModelConfig) -> StatsSpec:
    del config
    return StatsSpec(extra=("attention_rows",))

  def init_state(self, config: ModelConfig, batch: int) -> D2CacheState:
    s, g0 = self.layout.seq_len, self.layout.gen_start
    return D2CacheState(conf=jnp.zeros((batch, s - g0), jnp.float32), importance=jnp.ones((batch, s), jnp.float32),
                        density=jnp.zeros((batch, s - g0), jnp.float32), queries=jnp.ones((batch, s), bool),
                        was_unresolved=jnp.zeros((batch, s), bool), count=jnp.full((batch,), s, jnp.int32),
                        overflow=jnp.zeros((batch,), bool), rows=jnp.full((batch,), s, jnp.int32),
                        block=jnp.zeros((batch,), jnp.int32))

  def record(self, state: D2CacheState) -> dict[str, jax.Array]:
    """{"count": [B] int32 the official query count of the call (S at a full call), "overflow": [B] bool it did
    not fit query_budget (the call was not the official one), "rows": [B] int32 the query rows the call ran —
    its bucket, padding rows included (the compute; S at a full call)}."""
    return {"count": state.count, "overflow": state.overflow, "rows": state.rows}

  def call_flops(self, config: ModelConfig, computed: np.ndarray, keys: float, record: dict) -> float:
    """Trunk FLOPs of one row's call (`ComputePolicy.call_flops`): what the program computes, not the positions the
    rule selects (`Trace.computed_positions`): the record's "rows" — the call's bucket, padding rows included (in the
    batch-invariant mode each row's own); S at a full call — each over the `keys` keys it reads (S)."""
    del computed
    return cost.trunk_flops(config, float(record["rows"]), float(keys))

  def _block_mask(self, block: jax.Array) -> jax.Array:
    """[B, G] bool: the blocks starting at generated positions block [B]."""
    index = jnp.arange(self.layout.seq_len - self.layout.gen_start)[None]
    return (index >= block[:, None]) & (index < block[:, None] + self.layout.block_length)

  def _block(self, context: Any, batch: int) -> jax.Array:
    """[B] int32: the first generated position of the call's block (the whole generation without blocks)."""
    start = 0 if context.block_start is None else jnp.asarray(context.block_start, jnp.int32) - self.layout.gen_start
    return jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch,))

  def _generating(self, unresolved: jax.Array, block: jax.Array) -> jax.Array:
    """[B] bool: rows with an unresolved position in their block [B] (the official `active_seq_mask`)."""
    return jnp.any(unresolved[:, self.layout.gen_start:] & self._block_mask(block), axis=-1)

  def _official_set(self, state: D2CacheState, context: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The query set of this call as the official code builds it (`on_step_end` of the previous call, in that
    call's block, the top-up at this one): (queries [B, S] bool, before the top-up; the same after it and
    restricted to the generating rows; the certainty scores [B, G])."""
    g0 = self.layout.gen_start
    unresolved = context.unresolved
    block_mask = self._block_mask(state.block)
    before = self._generating(state.was_unresolved, state.block)
    decided, scores = d2cache.query_mask(self, remaining=unresolved[:, g0:], block_mask=block_mask,
                                         decoded=(state.was_unresolved & ~unresolved)[:, g0:], conf_cache=state.conf,
                                         importance=state.importance, shifted=self.layout.logit_shift == 1,
                                         active=before)
    decided = jnp.where(before[:, None], decided, state.queries)
    scores = jnp.where(before[:, None], scores, state.density)
    now = self._generating(unresolved, self._block(context, unresolved.shape[0]))
    computed = decided
    if self.top_up:
      computed = d2cache.top_up(decided, state.importance, scores, now)
    return decided, computed & now[:, None], scores

  def decide(self, state: D2CacheState, context: Any) -> Decision:
    s = self.layout.seq_len
    _, computed, _ = self._official_set(state, context)
    largest = self.buckets[-1]
    queries = jnp.sort(jnp.where(computed, jnp.arange(s, dtype=jnp.int32), s), axis=-1)[:, :largest]
    return Decision(full=jnp.asarray(context.step, jnp.int32) == 0, queries=queries.astype(jnp.int32),
                    buckets=self.buckets)

  def update(self, state: D2CacheState, output: ForwardOutput, context: Any, decision: Decision) -> D2CacheState:
    s, g0 = self.layout.seq_len, self.layout.gen_start
    b = state.conf.shape[0]
    full = decision.full
    decided, computed_set, scores = self._official_set(state, context)
    computed = jnp.where(full, True, jnp.zeros((b, s), bool).at[jnp.arange(b)[:, None], decision.queries].set(
        True, mode="drop"))
    unresolved = context.unresolved
    block = self._block(context, b)
    generating = self._generating(unresolved, block)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    importance = d2cache.rollout_importance(output.stats["attention_rows"], positions, computed)
    lo, hi = g0 - self.layout.logit_shift, s - self.layout.logit_shift  # the outputs that predict [g0, S)
    probability = jnp.where(unresolved[:, g0:], output.max_probability[:, lo:hi], -jnp.inf)
    conf = jnp.where(full, probability, d2cache.update_confidence_cache(
        state.conf, probability, computed[:, lo:hi], unresolved[:, g0:], self.frozen_confidence))
    count = jnp.sum(computed_set, axis=-1, dtype=jnp.int32)
    rows = jnp.broadcast_to(jnp.where(full, s, decision.bucket_rows(s)[1]), (b,))
    return D2CacheState(conf=conf, importance=jnp.where(generating[:, None], importance, state.importance),
                        density=jnp.where(full, state.density, scores),
                        queries=jnp.where(full, state.queries, decided), was_unresolved=unresolved,
                        count=jnp.where(full, s, count), overflow=~full & (count > self.buckets[-1]), rows=rows,
                        block=block)
