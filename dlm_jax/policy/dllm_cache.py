"""dLLM-Cache (adaptive feature caching, ICML 2026): per layer, which prompt and response positions a model
call recomputes, from two refresh intervals and the cosine similarity of fresh and cached values. Rules as read
in maomaocun/dLLM-cache: `dllm_cache/hooks/cache_hook_LLaDA.py` (`cache_hook_feature`, `refresh_index`),
`dllm_cache/hooks/cache_hook_Dream.py` (the same branches for Dream) and the `dLLMCache` class (`update_step`,
`refresh_gen`, `refresh_prompt`, `current_step`; read in copies of `dllm_cache/cache/Cache.py`, which is not in
our index); per-task intervals from Kamichanw/d2Cache `configs/gen_args.py`. Facts only; no code of theirs is
copied.

What the official code does:

* Schedule (`dLLMCache`): each layer's hook first increments that layer's call counter; `current_step` is the
  max over the layers' counters, so every layer of the n-th model call since `reset_cache` (one per
  generation, before the block loop: the counter runs across blocks) sees n. The response ("gen", every
  position after the prompt, future blocks included) is fully refreshed when (n − 1) % gen_interval_steps
  == 0, the prompt when (n − 1) % prompt_interval_steps == 0: with a 0-based `call_index`, when
  call_index % interval == 0, so the first call is full.
* Layer 0 (`cache_hook_feature`): `refresh_gen = … or layer_id == 0` and the same for the prompt, so layer 0
  is fully recomputed at every call (`refresh_layer0=True`, the default). Missing from the paper
  (maomaocun/dLLM-cache issue #6, filed by d2Cache's author, pointing at commit e289751 lines 156-157); the
  same two lines are in copies of the hook at that commit. The revision stored in our index (5aa31dd)
  does not have them — set False for that behaviour.
* Adaptive refresh at a layer whose response is not fully refreshed, when 0 < transfer_ratio <= 1 and
  ⌊G · transfer_ratio⌋ > 0 (in the copies with the layer-0 lines; 5aa31dd checks the ratio only):
  V = v_proj(attn_norm(x)) for every response position; cosine similarity with the cached response V over
  the whole projected vector (all KV heads flattened, pre-RoPE; `torch.nn.functional.cosine_similarity`,
  eps 1e-8); the ⌊G · transfer_ratio⌋ LOWEST positions (`torch.topk(largest=False)`, G the whole response
  length) get Q, K, attention output (after the output projection) and FFN output recomputed; the cached
  response V is replaced for ALL response positions; every other response position reuses its cached K,
  attention output and FFN output (the residual stream still adds them to the fresh input). The prompt, when
  not refreshed, reuses K, V, attention output and FFN output.
* A refreshed prompt without a refreshed response: prompt Q/K/V/attention/FFN recomputed, plus the adaptive
  response set as above, in one attention call.

UNVERIFIED: the official `scripts/` folder and `Cache.py` are not in our index; per-task intervals come from
d2Cache's table (`configs/gen_args.py`, which matches the values the reference note quotes from `scripts/` for
LLaDA GSM8K and HumanEval) and the ratio 0.25 from the note, the demos (`demo_LLaDA.py`: 100 / 7 / 0.25) and
d2Cache's `dLLMCache(rou=0.25)`. Whether the Dream hook at e289751 also forces layer 0 was not read.
Similarities are computed in float32 here (bf16 in the official runs).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

# (prompt_interval_steps, gen_interval_steps) per task and model, Kamichanw/d2Cache configs/gen_args.py.
_INTERVALS = {
    "gsm8k": {"llada": (50, 7), "llada-base": (25, 5), "dream": (25, 2), "dream-base": (100, 8)},
    "humaneval": {"llada": (25, 5), "llada-base": (50, 5), "dream": (50, 1), "dream-base": (5, 1)},
    "math-500": {"llada": (50, 1), "llada-base": (50, 8), "dream": (50, 1), "dream-base": (100, 4)},
    "mbpp": {"llada": (100, 5), "llada-base": (25, 4), "dream": (10, 8), "dream-base": (25, 8)},
}
_FAMILIES = ("llada", "llada-base", "dream", "dream-base", "mmada")


@dataclasses.dataclass(frozen=True)
class DLLMCacheSettings:
  """dLLM-Cache's knobs (module docstring). Defaults: LLaDA-8B-Instruct on GSM8K (prompt_interval_steps 50,
  gen_interval_steps 7, transfer_ratio 0.25; block 8, gen 256, steps 256 in the official script as the
  reference note quotes it). transfer_ratio 0 is an official setting: no adaptive refresh between the
  interval refreshes. refresh_layer0: layer 0 fully recomputed at every call (official, True) or scheduled
  like the others (False)."""

  NAME: ClassVar[str] = "dllm_cache"
  prompt_interval_steps: int = 50
  gen_interval_steps: int = 7
  transfer_ratio: float = 0.25
  refresh_layer0: bool = True

  def __post_init__(self):
    self.check()

  def check(self) -> None:
    """Refuses, in one line, a knob out of range."""
    for name in ("prompt_interval_steps", "gen_interval_steps"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"dllm_cache {name} must be an int >= 1, got {value!r}.")
    ratio = self.transfer_ratio
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= ratio <= 1.0:
      raise ValueError(f"dllm_cache transfer_ratio must be a number in [0, 1] (0 = no adaptive refresh), "
                       f"got {ratio!r}.")
    if not isinstance(self.refresh_layer0, bool):
      raise ValueError(f"dllm_cache refresh_layer0 must be True or False, got {self.refresh_layer0!r}.")

  def refresh_count(self, gen_length: int) -> int:
    """Response positions adaptively refreshed per layer: ⌊gen_length · transfer_ratio⌋ (Python's int of the
    float product, as the official code), 0 when the ratio is 0."""
    return int(gen_length * self.transfer_ratio)

  @classmethod
  def published(cls, family: str, task: str = "gsm8k") -> "DLLMCacheSettings":
    """Official intervals for family "llada", "dream" (Instruct models), "llada-base", "dream-base" or
    "mmada" and task "gsm8k", "humaneval", "math-500", "mbpp"; ratio 0.25. Source: Kamichanw/d2Cache
    `configs/gen_args.py` (`get_generation_args`, case "dllm"), whose LLaDA values match dLLM-Cache's
    scripts as the reference note quotes them. MMaDA has no published values: LLaDA-Instruct's (same
    architecture; our choice)."""
    if family not in _FAMILIES:
      raise ValueError(f"dllm_cache published family must be one of {', '.join(_FAMILIES)}, got {family!r}.")
    if task not in _INTERVALS:
      raise ValueError(f"dllm_cache published task must be one of {', '.join(_INTERVALS)}, got {task!r}.")
    prompt, gen = _INTERVALS[task]["llada" if family == "mmada" else family]
    return cls(prompt_interval_steps=prompt, gen_interval_steps=gen, transfer_ratio=0.25)


def value_similarity(fresh: jax.Array, cached: jax.Array) -> jax.Array:
  """Cosine similarity per response position of fresh and cached values, both [B, G, ...] (v_proj output of
  the layer's attention input, pre-RoPE, every KV head: [B, G, K·H] or [B, G, K, H]), over all trailing axes:
  x·y / max(norm(x)·norm(y), 1e-8). -> [B, G] float32."""
  x = fresh.reshape(fresh.shape[:2] + (-1,)).astype(jnp.float32)
  y = cached.reshape(cached.shape[:2] + (-1,)).astype(jnp.float32)
  dot = jnp.sum(x * y, axis=-1)
  norms = jnp.sqrt(jnp.sum(x * x, axis=-1)) * jnp.sqrt(jnp.sum(y * y, axis=-1))
  return dot / jnp.maximum(norms, 1e-8)


def refresh_positions(similarity: jax.Array, count: int) -> jax.Array:
  """The `count` response positions of lowest similarity [B, G], ascending. -> [B, count] int32 (a fixed
  count: no validity mask). Ties go to the lower position (a stable sort: the order `lax.top_k` of the negated
  similarity gives, but partitioned row by row on a sharded batch, where XLA gathers every row for a top-k)."""
  lowest = jnp.argsort(similarity, axis=-1, stable=True)[:, :count]
  return jnp.sort(lowest, axis=-1).astype(jnp.int32)


def schedule(settings: DLLMCacheSettings, call_index: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
  """(prompt fully refreshed, response fully refreshed) at a layer (int or traced int32) of model call
  call_index (0-based since the generation began, across blocks; traced int32, any shape). -> two bool
  arrays of call_index's shape."""
  first_layer = (jnp.asarray(layer) == 0) & settings.refresh_layer0
  prompt = (call_index % settings.prompt_interval_steps == 0) | first_layer
  gen = (call_index % settings.gen_interval_steps == 0) | first_layer
  return prompt, gen


def layer_plan(settings: DLLMCacheSettings, similarity: jax.Array, call_index: jax.Array, layer,
               prompt_length: int) -> tuple[jax.Array, jax.Array]:
  """What one layer of one call computes, over the sequence [B, S] (S = prompt_length + G).

  similarity [B, G]: `value_similarity` of this layer's fresh and cached response values (read only when
  the response is not fully refreshed and `refresh_count(G)` > 0); call_index [B] int32; layer: int or
  traced. -> (queries [B, S] bool: positions whose Q, K, attention output and FFN output are recomputed —
  the others reuse their cached K, V, attention output and FFN output; values [B, S] bool: positions whose
  cached V is replaced — every response position at an adaptive refresh)."""
  b, g = similarity.shape
  prompt_full, gen_full = schedule(settings, call_index, layer)
  count = settings.refresh_count(g)
  adaptive = jnp.zeros((b, g), bool)
  if count > 0:
    adaptive = adaptive.at[jnp.arange(b)[:, None], refresh_positions(similarity, count)].set(True)
  prompt = jnp.broadcast_to(prompt_full[:, None], (b, prompt_length))
  queries = jnp.concatenate([prompt, gen_full[:, None] | adaptive], axis=-1)
  values = jnp.concatenate([prompt, jnp.broadcast_to(gen_full[:, None] | (count > 0), (b, g))], axis=-1)
  return queries, values
