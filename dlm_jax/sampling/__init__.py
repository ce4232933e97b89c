"""Compiled samplers, each one jitted program returning a `Trace`.

  llada.generate             LLaDA `generate`; MMaDA t2t / mmu / mmu_generate_fast via `llada.mmada_options`
  dream.diffusion_generate   Dream `diffusion_generate`
  autoregressive.generate    KV-cache decoding of the autoregressive baselines
  schedules                  LLaDA transfer counts, Dream timesteps (torch.linspace, bit for bit)
"""

from dlm_jax.sampling import autoregressive, dream, llada, schedules
from dlm_jax.sampling.autoregressive import AROptions
from dlm_jax.sampling.dream import DreamOptions
from dlm_jax.sampling.llada import LLaDAOptions, mmada_options
from dlm_jax.sampling.trace import Trace

__all__ = ["AROptions", "DreamOptions", "LLaDAOptions", "Trace", "autoregressive", "dream", "llada", "mmada_options",
           "schedules"]
