"""What the experiment binaries share: flags and files, one module per concern with its flags and settings
together — runtime (`devices`), numerics (`numerics`), decoding (`decoding_flags`: the modes; `decoding`: the
sampler call over a batch), the analysis binaries' task and decoding flags (`analysis_flags`), output
(`output_flags`), training (`train_flags`), tasks (`items`, `prompts`, `scoring`) — checkpoint names
(`checkpoints`), run directories with resumable results, atomic files, progress and the one-line error
convention (`cli`). The decoding session itself (checkpoint bundle, decoding modes, settings → sampler
options, steering files) is the library's: `dlm_jax.session`."""
