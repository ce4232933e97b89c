"""What the experiment binaries share: flags turned into settings (`*_flags`), checkpoints and devices, items
and prompts, decoding settings and the sampler call (`decoding`, `decoding_modes`), scoring, run directories
with resumable results, atomic files, progress and the one-line error convention (`cli`)."""
