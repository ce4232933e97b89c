"""Sparse autoencoders in SAELens's on-disk format: a directory with cfg.json and sae_weights.safetensors.

cfg.json (SAELens 6.x, `SAEConfig.to_dict`): d_in, d_sae, dtype, device, apply_b_dec_to_input,
normalize_activations, reshape_activations ("none" or "hook_z": a [N, H] head site flattened to N·H),
architecture ("standard", "topk", "jumprelu", ...), TopK's k and rescale_acts_by_decoder_norm, and metadata
{hook_name, model_name, sae_lens_version, ...}. Files written before SAELens 6 keep hook_name (or
hook_point) and model_name at the top level and may name a TopK SAE by activation_fn "topk" with
activation_fn_kwargs {"k": ...}; both are read.

sae_weights.safetensors: W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in], b_dec [d_in], and
threshold [d_sae] for JumpReLU (log_threshold, its training form, is read as exp(log_threshold)). Weights are
loaded as float32 whatever the file's dtype.

Every problem is one line (`SAEFileError`) naming the file and what was expected, raised before any weight is
used. `check_site` compares an SAE with the site it is to run at.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from dlm_jax.config import ModelConfig
from dlm_jax.instrument import sae as sae_lib
from dlm_jax.instrument import sites
from dlm_jax.io.json_files import read_json
from dlm_jax.io.output_dir import atomic_output_dir

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
DTYPES = ("float32", "float64", "float16", "bfloat16")
SAELENS_VERSION_WRITTEN = "6.54.12"
"""The SAELens version whose format `save` writes (the version tested against)."""


class SAEFileError(ValueError):
  """An SAE directory is missing, malformed, or does not fit the site it is used at (one line)."""


@dataclasses.dataclass(frozen=True)
class SAEFile:
  """A loaded SAE: the `SAE` and what its cfg.json says about where it belongs.

  hook_name: the TransformerLens hook it was trained on (None when the file does not say);
  model_name: the model it was trained on (None when unknown); reshape: "none" or "hook_z";
  path: the directory; metadata: cfg.json's metadata object."""

  sae: sae_lib.SAE
  hook_name: str | None
  model_name: str | None
  reshape: str
  path: str
  metadata: dict[str, Any]


def _field(cfg: dict[str, Any], name: str, kind, where: str, default: Any = None) -> Any:
  value = cfg.get(name, default)
  if kind is int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
  else:
    ok = isinstance(value, kind)
  if not ok:
    raise SAEFileError(f"{where}: {name} must be {'a positive integer' if kind is int else kind.__name__}, got "
                       f"{value!r}.")
  return value


def _architecture(cfg: dict[str, Any]) -> tuple[str, int]:
  """(architecture, k) from a 6.x or an older cfg.json."""
  architecture = cfg.get("architecture")
  kwargs = cfg.get("activation_fn_kwargs") or {}
  if architecture is None:
    legacy = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
    architecture = "topk" if legacy == "topk" else "standard"
  k = cfg.get("k", kwargs.get("k", 0) if isinstance(kwargs, dict) else 0)
  return architecture, k


def _normalization(cfg: dict[str, Any], where: str) -> str:
  value = cfg.get("normalize_activations", "none")
  if value is None or value is False:
    return "none"
  if value not in sae_lib.NORMALIZATIONS:
    raise SAEFileError(f"{where}: normalize_activations {value!r} is not supported (expected one of "
                       f"{', '.join(sae_lib.NORMALIZATIONS)}); its scaling is not in the file — fold it into the "
                       "weights with SAELens (fold_activation_norm_scaling_factor / fold_activation_whitening) and "
                       "save again.")
  return value


def read_config(path: str) -> dict[str, Any]:
  """cfg.json of the SAE directory `path`, decoded (one-line errors)."""
  where = os.path.join(path, CFG_FILE)
  if not os.path.isdir(path):
    raise SAEFileError(f"{path}: no such SAE directory (expected {CFG_FILE} and {WEIGHTS_FILE} in it).")
  if not os.path.isfile(where):
    raise SAEFileError(f"{where}: missing (an SAELens SAE directory holds {CFG_FILE} and {WEIGHTS_FILE}).")
  return read_json(where, SAEFileError)


def _weights(path: str, d_in: int, d_sae: int, architecture: str) -> dict[str, np.ndarray]:
  where = os.path.join(path, WEIGHTS_FILE)
  if not os.path.isfile(where):
    raise SAEFileError(f"{where}: missing (an SAELens SAE directory holds {CFG_FILE} and {WEIGHTS_FILE}).")
  try:
    tensors = load_file(where)
  except (SafetensorError, OSError, ValueError) as e:
    raise SAEFileError(f"{where}: not a readable safetensors file ({str(e).splitlines()[0]}).") from None
  if "log_threshold" in tensors and "threshold" not in tensors:
    tensors["threshold"] = np.exp(tensors.pop("log_threshold").astype(np.float32))
  scaling = tensors.pop("scaling_factor", None)
  if scaling is not None and not np.all(scaling == 1):
    raise SAEFileError(f"{where}: holds a finetuning scaling_factor other than 1, which this loader does not apply.")
  expected = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
  if architecture == "jumprelu":
    expected["threshold"] = (d_sae,)
  extra = sorted(set(tensors) - set(expected))
  if extra:
    raise SAEFileError(f"{where}: unexpected tensor {extra[0]!r} for a {architecture} SAE (expected "
                       f"{', '.join(expected)}).")
  for name, shape in expected.items():
    if name not in tensors:
      raise SAEFileError(f"{where}: tensor {name} is missing (a {architecture} SAE has {', '.join(expected)}).")
    if tuple(tensors[name].shape) != shape:
      raise SAEFileError(f"{where}: tensor {name} has shape {list(tensors[name].shape)}; cfg.json's d_in {d_in} "
                         f"and d_sae {d_sae} give {list(shape)}.")
    tensors[name] = np.asarray(tensors[name], np.float32)
    if not np.all(np.isfinite(tensors[name])):
      raise SAEFileError(f"{where}: tensor {name} holds non-finite values.")
  tensors.setdefault("threshold", np.zeros((d_sae,), np.float32))
  return tensors


def load(path: str | os.PathLike) -> SAEFile:
  """The SAE saved by SAELens (`SAE.save_model`) or by `save` in directory `path`."""
  path = os.fspath(path)
  cfg = read_config(path)
  where = os.path.join(path, CFG_FILE)
  d_in, d_sae = _field(cfg, "d_in", int, where), _field(cfg, "d_sae", int, where)
  dtype = str(cfg.get("dtype", "float32")).removeprefix("torch.")
  if dtype not in DTYPES:
    raise SAEFileError(f"{where}: dtype {cfg.get('dtype')!r} is not one of {', '.join(DTYPES)}.")
  architecture, k = _architecture(cfg)
  if architecture not in sae_lib.ARCHITECTURES:
    raise SAEFileError(f"{where}: architecture {architecture!r} is not supported (expected one of "
                       f"{', '.join(sae_lib.ARCHITECTURES)}).")
  if architecture == "topk" and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_sae):
    raise SAEFileError(f"{where}: a topk SAE needs k in 1..d_sae={d_sae}, got {k!r}.")
  reshape = cfg.get("reshape_activations", "none")
  if reshape not in ("none", "hook_z"):
    raise SAEFileError(f"{where}: reshape_activations {reshape!r} is not one of none, hook_z.")
  metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
  head_index = metadata.get("hook_head_index", cfg.get("hook_head_index"))
  if head_index is not None:
    raise SAEFileError(f"{where}: hook_head_index {head_index!r} (an SAE of one head) is not supported; the SAE "
                       "must read the whole site.")
  tensors = _weights(path, d_in, d_sae, architecture)
  sae = sae_lib.SAE(
      W_enc=jnp.asarray(tensors["W_enc"]), b_enc=jnp.asarray(tensors["b_enc"]), W_dec=jnp.asarray(tensors["W_dec"]),
      b_dec=jnp.asarray(tensors["b_dec"]), threshold=jnp.asarray(tensors["threshold"]), architecture=architecture,
      k=int(k) if architecture == "topk" else 0,
      apply_b_dec_to_input=bool(_field(cfg, "apply_b_dec_to_input", bool, where, True)),
      rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
      normalize_activations=_normalization(cfg, where))
  hook_name = metadata.get("hook_name", cfg.get("hook_name", cfg.get("hook_point")))
  model_name = metadata.get("model_name", cfg.get("model_name"))
  return SAEFile(sae=sae, hook_name=hook_name if isinstance(hook_name, str) else None,
                 model_name=model_name if isinstance(model_name, str) else None, reshape=reshape, path=path,
                 metadata=dict(metadata))


def check_site(sae_file: SAEFile, config: ModelConfig, site: str) -> None:
  """Raises SAEFileError (one line) when the SAE in `sae_file` cannot run at `site` (a full site name,
  "blocks.3.hook_resid_post") of a model with `config`: another hook name than the file's, or a d_in other
  than the site's flattened feature size."""
  kind, layer = sites.parse(site)
  why = sites.unavailable(config, kind, layer)
  if why is not None:
    raise SAEFileError(f"{sae_file.path}: {why}")
  if sae_file.hook_name is not None and sae_file.hook_name != site:
    raise SAEFileError(f"{sae_file.path}: the SAE was trained on {sae_file.hook_name!r}, not on the site {site!r}.")
  width = math.prod(sites.feature_shape(config, kind, layer))
  if sae_file.sae.d_in != width:
    raise SAEFileError(f"{sae_file.path}: the SAE's d_in is {sae_file.sae.d_in}, but {site} of {config.name} has "
                       f"{width} features.")
  if sae_file.reshape == "hook_z" and kind != "attn.hook_z":
    raise SAEFileError(f"{sae_file.path}: reshape_activations 'hook_z' is for attn.hook_z sites, not {site}.")


def config_dict(sae: sae_lib.SAE, hook_name: str | None, model_name: str | None,
                metadata: dict[str, Any] | None = None) -> dict[str, Any]:
  """The cfg.json SAELens 6.x writes for `sae` (float32 weights)."""
  sae_lib.check(sae)
  meta = {"sae_lens_version": SAELENS_VERSION_WRITTEN, "sae_lens_training_version": SAELENS_VERSION_WRITTEN,
          **(metadata or {})}
  if hook_name is not None:
    meta["hook_name"] = hook_name
  if model_name is not None:
    meta["model_name"] = model_name
  cfg = {"d_in": sae.d_in, "d_sae": sae.d_sae, "dtype": "float32", "device": "cpu",
         "apply_b_dec_to_input": sae.apply_b_dec_to_input, "normalize_activations": sae.normalize_activations,
         "reshape_activations": "hook_z" if hook_name is not None and hook_name.endswith("attn.hook_z") else "none",
         "metadata": meta}
  if sae.architecture == "topk":
    cfg.update(k=sae.k, rescale_acts_by_decoder_norm=sae.rescale_acts_by_decoder_norm)
  cfg["architecture"] = sae.architecture
  return cfg


def save(sae: sae_lib.SAE, path: str | os.PathLike, *, hook_name: str | None, model_name: str | None,
         metadata: dict[str, Any] | None = None, overwrite: bool = False) -> str:
  """Writes `sae` to directory `path` in SAELens's format (atomically: a temporary directory renamed), readable
  by `sae_lens.SAE.load_from_disk` and by `load`. Returns the path."""
  cfg = config_dict(sae, hook_name, model_name, metadata)
  tensors = {name: np.asarray(getattr(sae, name), np.float32) for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
  if sae.architecture == "jumprelu":
    tensors["threshold"] = np.asarray(sae.threshold, np.float32)
  with atomic_output_dir(path, overwrite=overwrite) as tmp:
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(tmp, WEIGHTS_FILE))
    with open(os.path.join(tmp, CFG_FILE), "w", encoding="utf-8") as f:
      json.dump(cfg, f, indent=1)
  return os.fspath(path)
