"""Sparse autoencoders as pure JAX functions: the encode / decode of SAELens's inference architectures.

An `SAE` holds the weights as traced arrays (so one compiled program serves every SAE of the same shapes and
architecture) and the architecture as static fields. Shapes: D = d_in (the site's flattened feature size),
F = d_sae (the number of features).

  encode(x)  = act(pre),  pre = (norm_in(x) − b_dec · apply_b_dec_to_input) @ W_enc + b_enc
    standard:  act = ReLU(pre)
    topk:      the k largest pre (times ‖W_dec[f]‖ with rescale_acts_by_decoder_norm) through ReLU, 0 elsewhere
    jumprelu:  ReLU(pre) · [pre > threshold]
  decode(a)  = norm_out(a' @ W_dec + b_dec), a' = a / ‖W_dec[f]‖ for a TopK SAE with rescale_acts_by_decoder_norm

norm_in / norm_out are SAELens's run-time activation normalisations: "none", "constant_norm_rescale"
(x · √D / ‖x‖, undone on the way out) and "layer_norm" (subtract the mean, divide by the unbiased standard
deviation + 1e-5; undone on the way out). They depend on the input, so `decode` takes the input the features
came from when the SAE normalises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

ARCHITECTURES = ("standard", "topk", "jumprelu")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
LAYER_NORM_EPS = 1e-5


@struct.dataclass
class SAE:
  """A sparse autoencoder (module docstring). W_enc [D, F], b_enc [F], W_dec [F, D], b_dec [D], threshold [F]
  (JumpReLU; zeros otherwise), float32. architecture: one of `ARCHITECTURES`; k: the TopK k (0 otherwise)."""

  W_enc: jax.Array  # noqa: N815  (SAELens's tensor names)
  b_enc: jax.Array
  W_dec: jax.Array  # noqa: N815
  b_dec: jax.Array
  threshold: jax.Array
  architecture: str = struct.field(pytree_node=False, default="standard")
  k: int = struct.field(pytree_node=False, default=0)
  apply_b_dec_to_input: bool = struct.field(pytree_node=False, default=True)
  rescale_acts_by_decoder_norm: bool = struct.field(pytree_node=False, default=False)
  normalize_activations: str = struct.field(pytree_node=False, default="none")

  @property
  def d_in(self) -> int:
    return int(self.W_enc.shape[0])

  @property
  def d_sae(self) -> int:
    return int(self.W_enc.shape[1])


def check(sae: SAE) -> None:
  """Raises ValueError (one line) for an architecture, k or normalisation this module does not run, or weights
  whose shapes disagree."""
  if sae.architecture not in ARCHITECTURES:
    raise ValueError(f"SAE architecture {sae.architecture!r} is not supported; expected one of "
                     f"{', '.join(ARCHITECTURES)}.")
  if sae.normalize_activations not in NORMALIZATIONS:
    raise ValueError(f"SAE normalize_activations {sae.normalize_activations!r} is not supported; expected one of "
                     f"{', '.join(NORMALIZATIONS)} (fold other scalings into the weights first).")
  d, f = sae.W_enc.shape
  expected = {"W_enc": (d, f), "b_enc": (f,), "W_dec": (f, d), "b_dec": (d,), "threshold": (f,)}
  for name, shape in expected.items():
    if tuple(getattr(sae, name).shape) != shape:
      raise ValueError(f"SAE weight {name} has shape {list(getattr(sae, name).shape)}; expected {list(shape)} "
                       f"for d_in {d}, d_sae {f}.")
  if sae.architecture == "topk" and not 1 <= sae.k <= f:
    raise ValueError(f"TopK SAE k must be in 1..d_sae={f}, got {sae.k}.")


def _norm_in(sae: SAE, x: jax.Array) -> jax.Array:
  if sae.normalize_activations == "constant_norm_rescale":
    return x * (sae.d_in ** 0.5 / jnp.linalg.norm(x, axis=-1, keepdims=True))
  if sae.normalize_activations == "layer_norm":
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    return centred / (jnp.std(x, axis=-1, keepdims=True, ddof=1) + LAYER_NORM_EPS)
  return x


def _norm_out(sae: SAE, y: jax.Array, like: jax.Array | None) -> jax.Array:
  if sae.normalize_activations == "none":
    return y
  if like is None:
    raise ValueError(f"decoding an SAE with normalize_activations={sae.normalize_activations!r} needs the input "
                     "the features came from (decode(sae, acts, like=x)).")
  like = like.astype(jnp.float32)
  if sae.normalize_activations == "constant_norm_rescale":
    return y / (sae.d_in ** 0.5 / jnp.linalg.norm(like, axis=-1, keepdims=True))
  return y * jnp.std(like, axis=-1, keepdims=True, ddof=1) + jnp.mean(like, axis=-1, keepdims=True)


def pre_activations(sae: SAE, x: jax.Array) -> jax.Array:
  """x [..., D] -> the encoder's pre-activations [..., F] (float32)."""
  x = _norm_in(sae, x.astype(jnp.float32))
  if sae.apply_b_dec_to_input:
    x = x - sae.b_dec
  return x @ sae.W_enc + sae.b_enc


def decoder_norms(sae: SAE) -> jax.Array:
  """[F] the L2 norm of each feature's decoder row."""
  return jnp.linalg.norm(sae.W_dec, axis=-1)


def activate(sae: SAE, pre: jax.Array) -> jax.Array:
  """The architecture's activation of pre-activations [..., F] -> feature activations [..., F]."""
  if sae.architecture == "standard":
    return jax.nn.relu(pre)
  if sae.architecture == "jumprelu":
    return jax.nn.relu(pre) * (pre > sae.threshold)
  if sae.rescale_acts_by_decoder_norm:
    pre = pre * decoder_norms(sae)
  top, index = jax.lax.top_k(pre, sae.k)
  return jnp.put_along_axis(jnp.zeros_like(pre), index, jax.nn.relu(top), axis=-1, inplace=False)


def encode(sae: SAE, x: jax.Array) -> jax.Array:
  """x [..., D] -> feature activations [..., F] float32."""
  return activate(sae, pre_activations(sae, x))


def decode(sae: SAE, acts: jax.Array, like: jax.Array | None = None) -> jax.Array:
  """Feature activations [..., F] -> the reconstruction [..., D] float32; like [..., D]: the input the features
  came from (needed only by a normalising SAE)."""
  if sae.architecture == "topk" and sae.rescale_acts_by_decoder_norm:
    acts = acts / decoder_norms(sae)
  return _norm_out(sae, acts @ sae.W_dec + sae.b_dec, like)


def reconstruct(sae: SAE, x: jax.Array) -> jax.Array:
  """x [..., D] -> decode(encode(x)) [..., D] float32."""
  return decode(sae, encode(sae, x), like=x)
