"""The case table of the call-path snapshot (`call_path_snapshot.py`, issue 35 item 6): plain data only.

Each row is one run: a model (an embedded checkpoint of `dlm_jax.default_models`, or a tiny preset with
random weights where no embedded model of the family exists), an entry point (a sampler of
`dlm_jax.sampling.registry` by name, "forward", "intervened_forward", or "init" for a preset's random
weights), the sampler's common settings and own option fields, and the names of the prompt layout,
statistics, intervention and hooks that `call_path_entries.py` builds. A row is recorded in the snapshot's
index as written here, so a comparison notices a table that changed between --write and --compare.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Case:
  """One run of the matrix.

  name: the case's file name in the snapshot directory.
  model: "tiny-dlm", "tiny-moe-dlm", "tiny-uniform-dlm", "tiny-arm" (embedded) or a `dlm_jax.config` preset
    name (random weights, frozen in the snapshot by its "init" case).
  entry: a sampler name ("llada", "mmada", "dream", "ar", "block_diffusion", "diffusion_gemma"), "forward",
    "intervened_forward" (the plain calls) or "init" (the preset's random weights).
  common: `registry.CommonSettings` fields; own: the sampler's other option fields ("rule": a decoding
    rule's name, built with its default knobs).
  prompt: "plain" (no prompt mask) or "padded" (prompt mask; the embedded prompts' leading pads, a random
    prompt's row 1 padded by two).
  stats, intervention, hooks: names of the builders in `call_path_entries` (None: none).
  sink_top_k: the per-step top-k sinks (0: off).
  key: "one" (one PRNG key for the batch) or "rows" (one key per row).
  batch_invariant: the sampler's row-by-row mode.
  """

  name: str
  model: str
  entry: str
  common: dict[str, Any] = dataclasses.field(default_factory=dict)
  own: dict[str, Any] = dataclasses.field(default_factory=dict)
  prompt: str = "plain"
  stats: str | None = None
  sink_top_k: int = 0
  intervention: str | None = None
  hooks: str | None = None
  key: str = "one"
  batch_invariant: bool = False


RANDOM_PRESETS = ("tiny-llada", "tiny-dream", "tiny-llada2", "tiny-diffusiongemma")
"""The presets whose random weights the matrix uses (one "init" case each)."""

_LLADA = dict(gen_length=16, steps=16, block_length=8)
_SMALL = dict(gen_length=8, steps=8, block_length=4)
_DREAM_BLOCKS = dict(gen_length=8, steps=8, block_length=4)
_AR = dict(gen_length=12)
_BD = dict(gen_length=4, steps=2, block_length=4)
_BD_THREE_BLOCKS = dict(gen_length=8, steps=2, block_length=4)
_DG_TWO_CANVASES = dict(gen_length=32, steps=4, block_length=16)
_DG = dict(gen_length=16, steps=4, block_length=16)
_DG_SMALL = dict(gen_length=4, steps=3, block_length=4)
_INVARIANT_PADDING = dict(padding="key", cfg_padding=True, shift_positions=True)

CASES: tuple[Case, ...] = (
    *(Case(f"init_{name}", name, "init") for name in RANDOM_PRESETS),
    # LLaDA on the embedded tiny-dlm: exact, threshold, factor, the KV caches, CFG, sampling, padding.
    Case("llada_exact", "tiny-dlm", "llada", _LLADA, stats="full", sink_top_k=2),
    Case("llada_threshold", "tiny-dlm", "llada", _LLADA, dict(threshold=0.9), stats="head_mean_layers", sink_top_k=1),
    Case("llada_factor", "tiny-dlm", "llada", _LLADA, dict(factor=1.0), stats="full"),
    Case("llada_factor_dllm", "tiny-dlm", "llada", _LLADA, dict(factor=1.0, factor_rule="dllm")),
    Case("llada_prefix_cache", "tiny-dlm", "llada", _LLADA, dict(cache="prefix"), stats="full", sink_top_k=2),
    Case("llada_dual_cache", "tiny-dlm", "llada", _LLADA, dict(cache="dual"), stats="full"),
    Case("llada_threshold_dual_cache", "tiny-dlm", "llada", _LLADA,
         dict(threshold=0.9, cache="dual", dual_cache_forwards="steps_per_block"), stats="full", sink_top_k=2),
    Case("llada_cfg", "tiny-dlm", "llada", dict(_LLADA, cfg_scale=1.0), stats="full", sink_top_k=2),
    Case("llada_sampled", "tiny-dlm", "llada", dict(_LLADA, temperature=0.7, remasking="random"), key="rows"),
    Case("llada_padded", "tiny-dlm", "llada", _LLADA, dict(_INVARIANT_PADDING, confidence_ranking="log_odds"),
         prompt="padded", stats="full", sink_top_k=2),
    Case("llada_batch_invariant", "tiny-dlm", "llada", _LLADA, dict(threshold=0.9), stats="full", sink_top_k=2,
         intervention="mask_sinks", hooks="capture", batch_invariant=True),
    # The decoding rules (dlm_jax.sampling.decoding_rules).
    *(Case(f"llada_rule_{rule}", "tiny-dlm", "llada", _LLADA, dict(rule=rule), stats="full")
      for rule in ("eb", "klass", "wino", "pc", "certainty_prior")),
    # Interventions and hooks on LLaDA.
    Case("llada_mask_sinks", "tiny-dlm", "llada", _LLADA, stats="full", intervention="mask_sinks"),
    Case("llada_sink_token_compose", "tiny-dlm", "llada", _LLADA, stats="full", intervention="sink_token_compose"),
    Case("llada_mask_keys_compose", "tiny-dlm", "llada", _LLADA, dict(cache="prefix"),
         intervention="mask_keys_compose"),
    Case("llada_capture", "tiny-dlm", "llada", _LLADA, hooks="capture"),
    Case("llada_edit", "tiny-dlm", "llada", _LLADA, hooks="edit"),
    Case("llada_step_schedule", "tiny-dlm", "llada", _LLADA, hooks="step_schedule"),
    Case("llada_patch", "tiny-dlm", "llada", _LLADA, dict(threshold=0.9), hooks="patch"),
    Case("llada_capture_mask_sinks", "tiny-dlm", "llada", _LLADA, stats="full", intervention="mask_sinks",
         hooks="capture"),
    Case("llada_edit_compose", "tiny-dlm", "llada", _LLADA, intervention="mask_keys_compose", hooks="edit"),
    Case("llada_threshold_dual_capture", "tiny-dlm", "llada", _LLADA, dict(threshold=0.9, cache="dual"),
         stats="full", hooks="capture"),
    Case("llada_cfg_edit", "tiny-dlm", "llada", dict(_LLADA, cfg_scale=1.0), hooks="edit"),
    # The mixture of experts: routing statistics and the router's logits.
    Case("moe_routing", "tiny-moe-dlm", "llada", _LLADA, stats="routing", sink_top_k=2),
    Case("moe_threshold_dual_routing", "tiny-moe-dlm", "llada", _LLADA, dict(threshold=0.9, cache="dual"),
         stats="routing"),
    Case("moe_router_capture", "tiny-moe-dlm", "llada", _LLADA, hooks="router_logits"),
    # MMaDA (random tiny-llada): classifier-free guidance, also over a padded batch (its official padding).
    Case("mmada_cfg", "tiny-llada", "mmada", dict(_SMALL, cfg_scale=1.5), stats="full", sink_top_k=2),
    Case("mmada_cfg_padded", "tiny-llada", "mmada", dict(_SMALL, cfg_scale=1.5),
         dict(padding="outer", cfg_padding=False), prompt="padded", stats="full"),
    # Dream (random tiny-dream, logit shift 1): its algorithms, Fast-dLLM's block modes, rules, padding, hooks.
    Case("dream_entropy", "tiny-dream", "dream", dict(gen_length=8, steps=8, alg="entropy"), stats="full",
         sink_top_k=2),
    Case("dream_origin_sampled", "tiny-dream", "dream", dict(gen_length=8, steps=8, temperature=0.5, top_p=0.9),
         key="rows"),
    Case("dream_threshold_dual_cache", "tiny-dream", "dream", _DREAM_BLOCKS, dict(threshold=0.9, cache="dual"),
         stats="full"),
    Case("dream_prefix_cache", "tiny-dream", "dream", dict(_DREAM_BLOCKS, alg="maskgit_plus"), dict(cache="prefix"),
         stats="full"),
    Case("dream_factor", "tiny-dream", "dream", _DREAM_BLOCKS, dict(factor=1.0)),
    Case("dream_padded", "tiny-dream", "dream", dict(gen_length=8, steps=8, alg="entropy"), prompt="padded",
         stats="full", sink_top_k=2),
    Case("dream_rule_klass", "tiny-dream", "dream", dict(gen_length=8, steps=8), dict(rule="klass"), stats="full"),
    Case("dream_rule_pc", "tiny-dream", "dream", dict(gen_length=8, steps=8), dict(rule="pc")),
    Case("dream_capture_mask_sinks", "tiny-dream", "dream", dict(gen_length=8, steps=8, alg="entropy"),
         intervention="mask_sinks", hooks="capture"),
    # The autoregressive sampler on the embedded tiny-arm (its prompts are always masked).
    Case("ar_greedy", "tiny-arm", "ar", _AR, dict(stop_at_eos=True), prompt="padded", stats="full", sink_top_k=2),
    Case("ar_sampled", "tiny-arm", "ar", dict(_AR, temperature=0.8, top_k=8, top_p=0.9), prompt="padded",
         key="rows"),
    Case("ar_mask_sinks", "tiny-arm", "ar", _AR, prompt="padded", intervention="mask_sinks"),
    Case("ar_capture_edit", "tiny-arm", "ar", _AR, prompt="padded", hooks="edit"),
    # Block diffusion (random tiny-llada2: block-causal attention, sigmoid-router MoE; a 6-token prompt: one
    # prefilled block, then two blocks, or three).
    Case("bd_llada2", "tiny-llada2", "block_diffusion", _BD_THREE_BLOCKS, stats="routing", sink_top_k=2),
    Case("bd_fast_dllm", "tiny-llada2", "block_diffusion", _BD, dict(transfer="fast_dllm", threshold=0.3),
         stats="full"),
    Case("bd_uncached", "tiny-llada2", "block_diffusion", _BD, dict(cache=False), stats="full"),
    Case("bd_editing", "tiny-llada2", "block_diffusion", _BD, dict(editing_threshold=0.5, max_post_steps=2)),
    Case("bd_capture_mask_sinks", "tiny-llada2", "block_diffusion", _BD, intervention="mask_sinks", hooks="capture"),
    # DiffusionGemma on the embedded tiny-uniform-dlm (one canvas, or two), and its MoE on the random preset.
    Case("dg_default", "tiny-uniform-dlm", "diffusion_gemma", _DG_TWO_CANVASES, stats="groups", sink_top_k=2,
         key="rows"),
    Case("dg_mask_sinks", "tiny-uniform-dlm", "diffusion_gemma", _DG, stats="groups", intervention="mask_sinks"),
    Case("dg_capture_edit", "tiny-uniform-dlm", "diffusion_gemma", _DG, hooks="edit"),
    Case("dg_moe_routing", "tiny-diffusiongemma", "diffusion_gemma", _DG_SMALL, stats="routing_no_norms"),
    # The plain forward and `intervened_forward` with hooks.
    Case("forward_stats", "tiny-dlm", "forward", stats="forward_groups"),
    Case("forward_moe_routing", "tiny-moe-dlm", "forward", stats="routing"),
    Case("intervened_forward_hooks", "tiny-dlm", "intervened_forward", stats="full_ungrouped",
         intervention="mask_keys", hooks="forward_hooks"),
    Case("intervened_forward_compose", "tiny-dlm", "intervened_forward", intervention="mask_keys_compose"),
)
"""The matrix, in run order."""
