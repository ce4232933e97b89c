"""Training: the objectives and the optax train step (objectives.py, re-exported here), the uniform-state
objective (uniform.py), training data and layouts (data.py) and the resumable, sharded loop (loop.py)."""

from dlm_jax.training.objectives import (LLADA_EPS, Noise, Objective, SinkTokenSpec, ar_loss_from_logits,
                                         as_prng_key, diffusion_inputs, draw_noise, init_train_state,
                                         learning_rate_schedule, loss_fn, make_optimizer, make_train_step,
                                         model_logits, pretrain_loss_from_logits, sft_loss_from_logits, step_key,
                                         token_cross_entropy, train_state_shardings)

__all__ = ["LLADA_EPS", "Noise", "Objective", "SinkTokenSpec", "ar_loss_from_logits", "as_prng_key",
           "diffusion_inputs", "draw_noise", "init_train_state", "learning_rate_schedule", "loss_fn", "make_optimizer",
           "make_train_step", "model_logits", "pretrain_loss_from_logits", "sft_loss_from_logits", "step_key",
           "token_cross_entropy", "train_state_shardings"]
