"""Training objectives and the optax train step: LLaDA masked diffusion (pretraining and SFT),
next-token prediction for the autoregressive baselines, and the extra sink token of Zhang et al.

Objectives (../shared/reference/models.md §2.10, papers.md §B.3–B.4), for tokens x [B, L]:

* pretrain: per row t ~ U(0, 1), p = (1 − ε)·t + ε (ε = 1e-3); every position is masked independently
  with probability p (replaced by the mask id). loss = Σ_masked CE / p  /  (B·L).
* sft: the same draw, then prompt positions are restored (never masked).
  loss = Σ_b Σ_masked CE / (p_b · answer_len_b)  /  B, with answer_len_b the number of non-prompt
  positions of row b (EOS padding included: padded EOS tokens are trained targets).
* uniform: DiffusionGemma-style uniform-state noise with self-conditioning over the answer canvas of the
  "sft" layout (`dlm_jax.training.uniform`; UNVERIFIED recipe).
* ar: next-token cross-entropy averaged over the scored targets of the batch: logits at position i
  predict token i+1, scored where `target_mask[:, i+1]` is True (PAD never scored). Normalised by the
  number of scored targets in the batch (token-level mean, not per sequence).

For a diffusion model with `logit_shift = 1` (Dream-style) the logits are aligned first by the shared rule
(`dlm_jax.config.logit_shift`: position i is read from the output at i − 1) and position 0, which has no
output before it, is never masked.

Extra sink token (`SinkTokenSpec`): a reserved vocabulary id whose embedding row is the learned sink
vector is inserted *after* noising, at the front (position 0, content at RoPE positions 1..L) or at the
end (position L), so it is never masked; its output is not computed (`logits_window`), so it is never
scored. Attention bias: the sink's query row sees only the sink; every token sees the sink.
`zero_value=True` keeps the sink's embedding row at exactly zero: with bias-free q/k/v projections its
hidden state then stays 0 through every block (RMSNorm(0) = 0, attention to itself returns v = 0, the
MLP maps 0 to 0), so its key and value are 0 in every layer — a zero-value sink whose attention score is
fixed at 0. The paper's Table 5 variant keeps a learned key and zeroes only the value
(`dlm_jax.model.attention.AttentionBias.zero_values` in the forward); training does not offer it.

Noise draws are a separate pure function (`draw_noise`) so a test can replay them exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from dlm_jax.runtime import sharding
from dlm_jax.training import uniform as training_uniform
from dlm_jax.instrument.interventions import add_sink_token, sink_token_bias, sink_token_index
from dlm_jax.core.attention_bias import AttentionBias
from dlm_jax.config import ModelConfig, logit_shift
from dlm_jax.model import Params, forward, init_params
from dlm_jax.runtime.sharding import ShardingRules
from dlm_jax.model.forward_inputs import CallInstruments, Compute, Readout

ObjectiveKind = Literal["pretrain", "sft", "ar", "uniform"]
Placement = Literal["front", "end"]
Batch = dict[str, jax.Array]
LLADA_EPS = 1e-3


@struct.dataclass
class Noise:
  """One draw of the forward (masking) process.

  p: [B] float32 mask probability per row, (1 − ε)·t + ε.
  masked: [B, L] bool, True where the token is replaced by the mask id (before prompt restoration).
  """

  p: jax.Array
  masked: jax.Array


def draw_noise(key: jax.Array, batch: int, length: int, eps: float = LLADA_EPS) -> Noise:
  """LLaDA's forward process for [batch, length] tokens: t ~ U(0,1) per row, iid masks with prob. p."""
  key_t, key_mask = jax.random.split(key)
  t = jax.random.uniform(key_t, (batch,), jnp.float32)
  p = (1.0 - eps) * t + eps
  masked = jax.random.uniform(key_mask, (batch, length), jnp.float32) < p[:, None]
  return Noise(p=p, masked=masked)


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """CE [B, L] float32 of integer targets [B, L] under logits [B, L, V]."""
  logits = logits.astype(jnp.float32)
  return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def pretrain_loss_from_logits(logits: jax.Array, tokens: jax.Array, masked: jax.Array, p: jax.Array) -> jax.Array:
  """Σ_masked CE / p / (B·L). logits [B, L, V] (aligned with tokens [B, L]); masked [B, L]; p [B]."""
  ce = token_cross_entropy(logits, tokens)
  weighted = jnp.where(masked, ce / p[:, None], 0.0)
  return jnp.sum(weighted) / tokens.size


def sft_loss_from_logits(logits: jax.Array, tokens: jax.Array, masked: jax.Array, p: jax.Array,
                         prompt_mask: jax.Array) -> jax.Array:
  """Σ_b Σ_masked CE / (p_b · answer_len_b) / B; `masked` must already exclude the prompt [B, L]."""
  ce = token_cross_entropy(logits, tokens)
  answer_len = jnp.maximum(jnp.sum(~prompt_mask, axis=1), 1).astype(jnp.float32)
  per_row = jnp.sum(jnp.where(masked, ce, 0.0), axis=1) / (p * answer_len)
  return jnp.mean(per_row)


def ar_loss_from_logits(logits: jax.Array, tokens: jax.Array, target_mask: jax.Array) -> jax.Array:
  """Mean next-token CE: logits [B, L, V] at i predict tokens[:, i+1], scored where target_mask[:, i+1]."""
  ce = token_cross_entropy(logits[:, :-1], tokens[:, 1:])
  scored = target_mask[:, 1:]
  return jnp.sum(jnp.where(scored, ce, 0.0)) / jnp.maximum(jnp.sum(scored), 1)


@dataclasses.dataclass(frozen=True)
class SinkTokenSpec:
  """The extra sink token in training: vocabulary id, placement, and whether its embedding row (hence its
  key and value, without q/k/v biases) is kept at zero. Its attention rule is the inference one
  (`dlm_jax.instrument.interventions.SinkToken` and `sink_token_bias`), so a model trained with it is
  decoded under exactly the mask it was trained with."""

  token_id: int
  placement: Placement = "front"
  zero_value: bool = False

  def __post_init__(self):
    if self.placement not in ("front", "end"):
      raise ValueError(f"SinkTokenSpec.placement must be 'front' or 'end', got {self.placement!r}.")

  def index(self, length: int) -> int:
    """Sequence index of the sink in the [L + 1] sequence."""
    return sink_token_index(self.placement, length + 1)

  def insert(self, tokens: jax.Array) -> jax.Array:
    """[B, L] -> [B, L + 1] with the sink id at `index(L)`."""
    return add_sink_token(tokens, self.token_id, self.placement)

  def positions(self, batch: int, length: int) -> jax.Array:
    """[B, L + 1] RoPE positions 0..L in sequence order (front: sink 0, content 1..L; end: sink L)."""
    return jnp.broadcast_to(jnp.arange(length + 1), (batch, length + 1))

  def bias(self, length: int) -> jax.Array:
    """[1, 1, L + 1, L + 1] additive bias: the sink's query row sees only the sink (papers.md §B.3)."""
    is_sink = jnp.arange(length + 1)[None, :] == self.index(length)
    return sink_token_bias(is_sink, jnp.arange(length + 1)).pairwise

  def window(self, length: int) -> tuple[int, int]:
    """The content positions of the [L + 1] sequence: their logits are the model's output."""
    return (1, length + 1) if self.placement == "front" else (0, length)


@dataclasses.dataclass(frozen=True)
class Objective:
  """What to train: the loss kind, an optional extra sink token, ε, the attention path, and for the
  uniform-state objective its settings (`dlm_jax.training.uniform.UniformNoise`)."""

  kind: ObjectiveKind
  sink: SinkTokenSpec | None = None
  eps: float = LLADA_EPS
  attention_impl: str = "chunked"
  uniform: training_uniform.UniformNoise | None = None

  def __post_init__(self):
    if self.kind not in ("pretrain", "sft", "ar", "uniform"):
      raise ValueError(f"Objective.kind must be 'pretrain', 'sft', 'ar' or 'uniform', got {self.kind!r}.")
    if self.kind in ("ar", "uniform") and self.sink is not None:
      raise ValueError("The extra sink token is a masked-diffusion variant; use objective 'pretrain' or 'sft'.")
    if (self.kind == "uniform") != (self.uniform is not None):
      raise ValueError("Objective 'uniform' needs its UniformNoise settings (and only it takes them).")

  def check(self, config: ModelConfig) -> None:
    """Raises ValueError when `config` cannot be trained with this objective."""
    if self.kind == "uniform":
      training_uniform.check(config)
      return
    if self.kind == "ar":
      if not config.causal or config.logit_shift != 1:
        raise ValueError(f"Objective 'ar' needs a causal config with logit_shift=1; {config.name} has "
                         f"causal={config.causal}, logit_shift={config.logit_shift}.")
      return
    if config.causal or config.mask_token_id is None:
      raise ValueError(f"Objective {self.kind!r} needs a bidirectional config with mask_token_id; {config.name} "
                       f"has causal={config.causal}, mask_token_id={config.mask_token_id}.")
    if self.sink is not None:
      if not 0 <= self.sink.token_id < config.vocab_size:
        raise ValueError(f"Sink token id {self.sink.token_id} is outside the vocabulary ({config.vocab_size}).")
      if self.sink.zero_value and config.qkv_bias:
        raise ValueError("zero_value sinks need bias-free q/k/v projections (qkv_bias=False): with a bias the "
                         "zero embedding still has a non-zero value.")


def model_logits(params: Params, tokens: jax.Array, *, config: ModelConfig, sink: SinkTokenSpec | None = None,
                 attention_impl: str = "chunked") -> jax.Array:
  """float32 logits [B, L, V] for tokens [B, L]; with a sink, it is inserted and its output dropped."""
  if sink is None:
    return forward(params, tokens, config=config, compute=Compute(attention_impl=attention_impl)).logits
  batch, length = tokens.shape
  return forward(params, sink.insert(tokens), config=config, positions=sink.positions(batch, length),
                 instruments=CallInstruments(bias=AttentionBias(pairwise=sink.bias(length))),
                 readout=Readout(window=sink.window(length)), compute=Compute(attention_impl=attention_impl)).logits


def _aligned_logits(outputs: jax.Array, shift: int) -> jax.Array:
  """Logits [B, L, V] whose row i predicts token i, from the outputs [B, L, V] of all L positions, by the
  model's shift rule (`dlm_jax.config.logit_shift`; with shift 1 the last output predicts nothing and row 0,
  never scored, repeats output 0)."""
  length = outputs.shape[1]
  start, stop = logit_shift.output_window(0, length, shift)
  return logit_shift.target_logits(outputs[:, start:stop], 0, shift)


def diffusion_inputs(batch: Batch, noise: Noise, *, config: ModelConfig, kind: ObjectiveKind) -> tuple[jax.Array, jax.Array]:
  """(noisy tokens [B, L], final mask [B, L]) after prompt restoration (sft) and the shift rule."""
  masked = noise.masked
  if kind == "sft":
    masked = masked & ~batch["prompt_mask"]
  if config.logit_shift:
    masked = masked.at[:, 0].set(False)
  noisy = jnp.where(masked, config.mask_token_id, batch["tokens"])
  return noisy, masked


def loss_fn(params: Params, batch: Batch, key: jax.Array, *, config: ModelConfig,
            objective: Objective) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The objective's scalar loss and metrics {loss, scored (token count), accuracy (argmax = target)}.

  batch: {"tokens", "prompt_mask", "target_mask"} [B, L] (see dlm_jax.training.data). key: the noise key
  (unused by "ar").
  """
  tokens = batch["tokens"]
  if objective.kind == "uniform":
    return training_uniform.loss(params, tokens, key, config=config, noise=objective.uniform,
                                 attention_impl=objective.attention_impl)
  if objective.kind == "ar":
    logits = model_logits(params, tokens, config=config, attention_impl=objective.attention_impl)
    loss = ar_loss_from_logits(logits, tokens, batch["target_mask"])
    scored, hits = batch["target_mask"][:, 1:], jnp.argmax(logits[:, :-1], -1) == tokens[:, 1:]
  else:
    noise = draw_noise(key, *tokens.shape, eps=objective.eps)
    noisy, masked = diffusion_inputs(batch, noise, config=config, kind=objective.kind)
    logits = _aligned_logits(model_logits(params, noisy, config=config, sink=objective.sink,
                                         attention_impl=objective.attention_impl), config.logit_shift)
    if objective.kind == "pretrain":
      loss = pretrain_loss_from_logits(logits, tokens, masked, noise.p)
    else:
      loss = sft_loss_from_logits(logits, tokens, masked, noise.p, batch["prompt_mask"])
    scored, hits = masked, jnp.argmax(logits, -1) == tokens
  n = jnp.sum(scored)
  accuracy = jnp.sum(hits & scored) / jnp.maximum(n, 1)
  return loss, {"loss": loss, "scored": n, "accuracy": accuracy}


# ----------------------------------------------------------------------------------------------------
# Optimizer and train step.


def learning_rate_schedule(lr: float, total_steps: int, warmup_steps: int, end_ratio: float = 0.1) -> optax.Schedule:
  """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to lr·end_ratio at total_steps."""
  warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(total_steps, warmup_steps + 1),
                                            end_value=lr * end_ratio)


def _decay_mask(params: Params) -> Any:
  """True for matrices (kernels, embeddings); norms and biases are not decayed."""
  return jax.tree_util.tree_map_with_path(lambda path, _: str(path[-1].key) in ("kernel", "embedding"), params)


def make_optimizer(*, lr: float, total_steps: int, warmup_steps: int, weight_decay: float = 0.1, b1: float = 0.9,
                   b2: float = 0.95, clip_norm: float = 1.0, end_ratio: float = 0.1) -> optax.GradientTransformation:
  """clip_by_global_norm(clip_norm) → AdamW(b1, b2, weight_decay on matrices) with warmup + cosine."""
  return optax.chain(
      optax.clip_by_global_norm(clip_norm),
      optax.adamw(learning_rate_schedule(lr, total_steps, warmup_steps, end_ratio), b1=b1, b2=b2,
                  weight_decay=weight_decay, mask=_decay_mask))


def _zero_sink_row(tree: Params, sink: SinkTokenSpec | None) -> Params:
  """Sets embedding row `sink.token_id` to 0 when the sink is a zero-value sink (params or grads)."""
  if sink is None or not sink.zero_value:
    return tree
  embed = tree["embed"]["embedding"]
  return {**tree, "embed": {**tree["embed"], "embedding": embed.at[sink.token_id].set(0)}}


def init_train_state(config: ModelConfig, key: jax.Array, optimizer: optax.GradientTransformation,
                     objective: Objective) -> dict[str, Any]:
  """{"params", "opt_state", "step"} with float32 random params (zero sink row for zero-value sinks)."""
  params = _zero_sink_row(init_params(config, key, jnp.float32), objective.sink)
  return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}


def step_key(seed: int, step: int | jax.Array) -> jax.Array:
  """The noise key of training step `step`: a function of (seed, step) only."""
  return jax.random.fold_in(jax.random.key(seed), step)


def as_prng_key(key: jax.Array) -> jax.Array:
  """A typed PRNG key from a typed key or its raw uint32 `jax.random.key_data`."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key)


def train_state_shardings(config: ModelConfig, mesh: Mesh, optimizer: optax.GradientTransformation,
                          objective: Objective, rules: ShardingRules = ShardingRules()) -> dict[str, Any]:
  """NamedSharding tree of the train state on `mesh`: the params by `sharding.param_shardings`, every copy
  of the params inside the optimizer state (Adam's moments) like the params, the rest (step and counters)
  replicated."""
  abstract = jax.eval_shape(lambda: init_train_state(config, jax.random.key(0), optimizer, objective))
  params = sharding.param_shardings(config, mesh, abstract["params"], rules)
  whole = sharding.replicated(mesh)
  opt_state = optax.tree_map_params(optimizer, lambda _, spec: spec, abstract["opt_state"], params,
                                    transform_non_params=lambda _: whole)
  return {"params": params, "opt_state": opt_state, "step": whole}


def make_train_step(config: ModelConfig, objective: Objective, optimizer: optax.GradientTransformation,
                    mesh: Mesh | None = None, rules: ShardingRules = ShardingRules()):
  """Jitted `(state, batch, key) -> (state, metrics)`; the input state's buffers are donated.

  key: a typed PRNG key or its raw `jax.random.key_data` (uint32), which is what a multi-process caller
  can place on a mesh. With a `mesh`, the state must be laid out by `train_state_shardings`, the batch
  rows are sharded over the batch axes and the key and metrics are replicated; XLA inserts the
  all-gathers of FSDP and the reductions of the gradients.
  """
  objective.check(config)

  def train_step(state, batch, key):
    key = as_prng_key(key)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, metrics), grads = grad_fn(state["params"], batch, key, config=config, objective=objective)
    grads = _zero_sink_row(grads, objective.sink)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = _zero_sink_row(optax.apply_updates(state["params"], updates), objective.sink)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

  if mesh is None:
    return jax.jit(train_step, donate_argnums=(0,))
  state = train_state_shardings(config, mesh, optimizer, objective, rules)
  whole = sharding.replicated(mesh)
  return jax.jit(train_step, in_shardings=(state, sharding.batch_sharding(mesh, 2, rules), whole),
                 out_shardings=(state, whole), donate_argnums=(0,))
