"""Compiled samplers on one driver, each run one jitted program returning a `Trace`.

  driver                     the one loop: prompt checks, sequence, statistics plan, model caller, runners
  llada.generate             LLaDA `generate`; MMaDA t2t / mmu / mmu_generate_fast via `llada.mmada_options`
  dream.diffusion_generate   Dream `diffusion_generate`, and Fast-dLLM's Dream block modes (dream_blockwise)
  autoregressive.generate    KV-cache decoding of the autoregressive baselines
  block_diffusion.generate   block diffusion with an exact KV cache (LLaDA2.x, SDAR, dInfer)
  diffusion_gemma.generate   DiffusionGemma's uniform-state block diffusion with self-conditioning
  registry                   every sampler by name: options class, options from common settings, generate, facts
  run_setup                  RunSetup: what a run records and changes and how it executes (every sampler's setup=)
  padding                    left-padding validity, shifted positions and padding biases
  selection                  top-k positions, logit filters, decode steps
  schedules                  LLaDA transfer counts, Dream timesteps (torch.linspace, bit for bit)
"""

from dlm_jax.sampling import (
    autoregressive, block_diffusion, diffusion_gemma, driver, dream, llada, padding, registry, schedules, selection)
from dlm_jax.sampling.autoregressive import AROptions
from dlm_jax.sampling.block_diffusion import BlockDiffusionOptions
from dlm_jax.sampling.diffusion_gemma import DiffusionGemmaOptions
from dlm_jax.sampling.dream import DreamOptions
from dlm_jax.sampling.llada import LLaDAOptions, mmada_options
from dlm_jax.sampling.run_setup import RunSetup
from dlm_jax.sampling.trace import Trace

__all__ = ["AROptions", "BlockDiffusionOptions", "DiffusionGemmaOptions", "DreamOptions", "LLaDAOptions", "RunSetup",
           "Trace", "autoregressive", "block_diffusion", "diffusion_gemma", "driver", "dream", "llada", "mmada_options",
           "padding", "registry", "schedules", "selection"]
