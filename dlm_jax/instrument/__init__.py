"""Looking inside a model call and acting on it: the statistics a forward computes (stats.py), the
interventions that change its attention (interventions.py), and activation hooks — named sites (sites.py),
what to capture and edit there (hook_spec.py, hook_call.py), their work inside the forward (site_hooks.py,
forward_sites.py). A sampler run's hooks are a field of its call plan (`dlm_jax.sampling.call_plan`)."""
