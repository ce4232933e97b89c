"""Smaller variants of the tiny presets, for tests whose subject is a loop, an objective or a binary rather than
the architecture: the same features in fewer layers, so that their compiled programs build faster.

The presets themselves stay as they are: the parity tests against transformers (test_diffusion_gemma.py and
the like) check every layer arrangement on them. BUILD.md ("Test": "Smaller models where the architecture is
not the subject") has the measured effect.
"""

from dlm_jax.config import preset

DIFFUSIONGEMMA_SG = preset("tiny-diffusiongemma").replace(name="tiny-diffusiongemma-sg", n_layers=2,
                                                          layer_pattern="sg")
"""tiny-diffusiongemma with two layers, one sliding-window and one global ("sg"): the preset's sliding and global
attention, mixture of experts beside the dense MLP, sandwich norms and self-conditioning, in two layer runs
instead of the preset's four ("ssgsg": two sliding, one global, one sliding, one global); every layer run is a
`lax.scan` of its own in every compiled forward, which is what the programs' build time follows."""

LLADA_BLOCK4 = preset("tiny-llada").replace(name="tiny-llada-block4", attention_block_size=4)
"""tiny-llada with block-causal attention in blocks of 4: a block diffusion model for tests whose subject is the
block diffusion loop, not tiny-llada2's mixture of experts, QK norm and partial RoPE (one layer run instead of
tiny-llada2's dense and MoE runs). Its parameters are tiny-llada's (the same tree), so a file that initialises
both compiles their initialisers once."""
