"""SAEs in SAELens's format: the real `sae-lens` package writes files from random weights, `dlm_jax.io.saelens`
reads them, and encode / decode equal sae-lens's on the same inputs (float32, ≤ 1e-5); what we write, sae-lens
reads back; bad files and sites are one line."""

from __future__ import annotations

import json
import os
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
sae_lens = pytest.importorskip("sae_lens")

from dlm_jax.config import preset  # noqa: E402
from dlm_jax.instrument import sae as sae_lib  # noqa: E402
from dlm_jax.io import saelens  # noqa: E402

D_IN, D_SAE = 12, 40
HOOK = "blocks.1.hook_resid_post"

CASES = {
    "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {}),
    "standard_no_bdec_in": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {"apply_b_dec_to_input": False}),
    "standard_layer_norm": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {"normalize_activations": "layer_norm"}),
    "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig, {"k": 5}),
    "topk_rescaled": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig, {"k": 7, "rescale_acts_by_decoder_norm": True}),
    "topk_norm_rescale": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig,
                          {"k": 3, "normalize_activations": "constant_norm_rescale"}),
    "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig, {}),
}


def _reference(case: str, seed: int):
  """A sae-lens SAE of `case` with random weights (biases and thresholds too)."""
  cls, cfg_cls, kwargs = CASES[case]
  cfg = cfg_cls(d_in=D_IN, d_sae=D_SAE, metadata=sae_lens.saes.sae.SAEMetadata(hook_name=HOOK, model_name="m"),
                **kwargs)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    sae = cls(cfg)
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in sae.named_parameters():
      p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name != "threshold" else 0.2))
      if name == "threshold":
        p.abs_()
  return sae


@pytest.fixture(scope="module", params=sorted(CASES))
def written(request, tmp_path_factory):
  """(case, the sae-lens SAE, its directory written by sae-lens's save_model)."""
  case = request.param
  sae = _reference(case, seed=sorted(CASES).index(case))
  path = str(tmp_path_factory.mktemp(case) / "sae")
  sae.save_model(path)
  return case, sae, path


def _inputs(seed: int = 7) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(3, 5, D_IN)).astype(np.float32) * 2.0


def test_encode_decode_equal_saelens(written):
  case, reference, path = written
  loaded = saelens.load(path)
  assert loaded.hook_name == HOOK and loaded.model_name == "m"
  assert loaded.sae.architecture == case.split("_")[0] and loaded.sae.d_in == D_IN and loaded.sae.d_sae == D_SAE
  x = _inputs()
  with torch.no_grad():
    acts_ref = reference.encode(torch.from_numpy(x))
    recon_ref = reference.decode(acts_ref).numpy()
    acts_ref = acts_ref.numpy()
  acts = np.asarray(sae_lib.encode(loaded.sae, jnp.asarray(x)))
  assert (acts_ref > 0).sum() > 0 and (acts_ref == 0).sum() > 0
  np.testing.assert_array_equal(acts > 0, acts_ref > 0)
  np.testing.assert_allclose(acts, acts_ref, atol=1e-5, rtol=0)
  recon = np.asarray(sae_lib.decode(loaded.sae, jnp.asarray(acts_ref), like=jnp.asarray(x)))
  np.testing.assert_allclose(recon, recon_ref, atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(sae_lib.reconstruct(loaded.sae, jnp.asarray(x))), recon_ref, atol=1e-5,
                             rtol=0)


def test_saved_files_load_in_saelens(written, tmp_path):
  case, reference, path = written
  loaded = saelens.load(path)
  out = saelens.save(loaded.sae, tmp_path / "ours", hook_name=HOOK, model_name="m")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    back = sae_lens.SAE.load_from_disk(out)
  assert type(back) is type(reference)
  assert back.cfg.to_dict() | {"metadata": None} == reference.cfg.to_dict() | {"metadata": None}
  assert back.cfg.metadata.hook_name == HOOK
  for name, p in reference.named_parameters():
    np.testing.assert_array_equal(dict(back.named_parameters())[name].detach().numpy(), p.detach().numpy())


def _write_cfg(path, **changes):
  cfg = json.loads((path / "cfg.json").read_text())
  cfg.update(changes)
  (path / "cfg.json").write_text(json.dumps(cfg))


def test_bad_files_and_sites_are_one_line(tmp_path):
  sae = _reference("topk", seed=0)
  good = tmp_path / "good"
  sae.save_model(str(good))
  loaded = saelens.load(good)
  tiny = preset("tiny-llada").replace(d_model=D_IN, n_heads=2, n_kv_heads=2, head_dim=6)
  saelens.check_site(loaded, tiny, HOOK)

  def one_line(match, fn, *args):
    with pytest.raises(saelens.SAEFileError, match=match) as e:
      fn(*args)
    assert "\n" not in str(e.value)

  one_line("trained on 'blocks.1.hook_resid_post', not on the site 'blocks.0.hook_resid_post'",
           saelens.check_site, loaded, tiny, "blocks.0.hook_resid_post")
  wide = tiny.replace(d_model=16, head_dim=8)
  one_line(r"d_in is 12, but blocks.1.hook_resid_post of .* has 16 features", saelens.check_site, loaded, wide, HOOK)
  one_line("no such SAE directory", saelens.load, tmp_path / "absent")
  for changes, match in (({"architecture": "gated"}, "architecture 'gated' is not supported"),
                         ({"k": 0}, "needs k in 1..d_sae=40"),
                         ({"d_in": 13}, r"tensor W_enc has shape \[12, 40\]; cfg.json's d_in 13"),
                         ({"normalize_activations": "expected_average_only_in"}, "not supported")):
    bad = tmp_path / f"bad{len(os.listdir(tmp_path))}"
    sae.save_model(str(bad))
    _write_cfg(bad, **changes)
    one_line(match, saelens.load, bad)
