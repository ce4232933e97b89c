"""lm-evaluation-harness for dlm_jax checkpoints: the `dlm_jax` model (`model`), its model_args (`args`,
`presets`), the request types (`generation`, `scoring`), local tasks (`tasks/`) and the entry points.

  python -m experiments.lm_eval --model dlm_jax --model_args checkpoint=tiny-dlm --tasks dlm_synthetic_gen
  python -m experiments.lm_eval.table1 --checkpoints=tiny-dlm,tiny-arm

Needs the `eval` extra (lm-eval); the library (`dlm_jax`) never imports lm-eval.
"""
