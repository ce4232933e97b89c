"""Sparse autoencoders at the named sites: the "sae" capture reduction, the SAE splice and feature edits.

The SAE (`dlm_jax.instrument.sae.SAE`) is a traced value (`CaptureValues.sae`, `EditValues.sae`), so one
compiled program serves every SAE of the same shapes and architecture. A site's values [B, T, F...] are
flattened to [B, T, D] (D = prod F: an attn.hook_z SAE reads the N·H head outputs, SAELens's "hook_z"
reshape) and back.

  capture reduce="sae"      the feature activations [B, S, d_sae], or with k ≥ 1 their k largest (`TopK`)
  Edit op "sae_splice"      x → decode(a'): the site replaced by the SAE's reconstruction (of the edited
                            features a'; a' = a = encode(x) without feature edits)
  Edit op "sae_features"    x → x + decode(a') − decode(a): the features edited, the SAE's error kept (no
                            feature edit: x unchanged)

Feature edits (per row, traced): a' = where(feature_mask, feature_value, a) + feature_add, so clamping feature
f to c is feature_mask[f] = True, feature_value[f] = c, and adding α times f's decoder direction is
feature_add[f] = α (with "sae_features": x + α · W_dec[f]).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from dlm_jax.config import ModelConfig
from dlm_jax.instrument import sae as sae_lib
from dlm_jax.instrument import sites

SAE_OPS = ("sae_splice", "sae_features")


def _flat(x: jax.Array) -> jax.Array:
  return x.reshape(*x.shape[:2], -1)


def features(sae: sae_lib.SAE, x: jax.Array) -> jax.Array:
  """Site values x [B, T, F...] -> feature activations [B, T, d_sae] float32."""
  return sae_lib.encode(sae, _flat(x))


def edited(op: str, sae: sae_lib.SAE, x: jax.Array, feature_mask: jax.Array | None,
           feature_value: jax.Array | None, feature_add: jax.Array | None) -> jax.Array:
  """x [B, T, F...] after `op` ("sae_splice" / "sae_features"; module docstring), float32, x's shape.
  feature_mask [B, d_sae] bool, feature_value [B, d_sae], feature_add [B, d_sae] (None: no such edit)."""
  flat = _flat(x).astype(jnp.float32)
  acts = sae_lib.encode(sae, flat)
  new_acts = acts
  if feature_mask is not None:
    new_acts = jnp.where(feature_mask[:, None, :], feature_value[:, None, :], new_acts)
  if feature_add is not None:
    new_acts = new_acts + feature_add[:, None, :]
  out = sae_lib.decode(sae, new_acts, like=flat)
  if op == "sae_features":
    out = flat + out - sae_lib.decode(sae, acts, like=flat)
  return out.reshape(x.shape)


def check_width(sae: sae_lib.SAE, config: ModelConfig, kind: str, layers: tuple[int | None, ...], what: str) -> None:
  """Raises ValueError (one line) when the SAE's d_in is not the flattened feature size of site `kind`."""
  sae_lib.check(sae)
  for layer in layers:
    width = math.prod(sites.feature_shape(config, kind, layer))
    if sae.d_in != width:
      raise ValueError(f"{what}: the SAE's d_in is {sae.d_in}, but {sites.full_name(kind, layer)} of {config.name} "
                       f"has {width} features.")


def edit_fields(edit: Any, config: ModelConfig, layers: tuple[int | None, ...], batch: int, what: str, row_array,
                sae: sae_lib.SAE | None, feature_mask: Any, feature_value: Any, feature_add: Any) -> dict[str, Any]:
  """The `EditValues` fields of an SAE edit (`sae` and the feature edits broadcast to [B, d_sae]); for any other
  edit, checks that none of them was given. row_array(x, batch, shape, dtype, what) broadcasts to rows."""
  given = [n for n, v in (("sae", sae), ("feature_mask", feature_mask), ("feature_value", feature_value),
                          ("feature_add", feature_add)) if v is not None]
  if edit.op not in SAE_OPS:
    if given:
      raise ValueError(f"{what} takes no {given[0]} (only the ops {', '.join(SAE_OPS)} do).")
    return {}
  if sae is None:
    raise ValueError(f"{what} needs sae=SAE (dlm_jax.io.saelens.load(path).sae).")
  check_width(sae, config, edit.site, layers, what)
  if (feature_mask is None) != (feature_value is None):
    raise ValueError(f"{what}: a feature clamp needs both feature_mask and feature_value [d_sae] = "
                     f"{[sae.d_sae]} (or [B, d_sae]).")
  out: dict[str, Any] = {"sae": sae}
  if feature_mask is not None:
    out["feature_mask"] = row_array(feature_mask, batch, (sae.d_sae,), bool, f"{what}: feature_mask")
    out["feature_value"] = row_array(feature_value, batch, (sae.d_sae,), jnp.float32, f"{what}: feature_value")
  if feature_add is not None:
    out["feature_add"] = row_array(feature_add, batch, (sae.d_sae,), jnp.float32, f"{what}: feature_add")
  return out
