"""experiments.generate gives the same tokens and statistics under every mesh of 8 CPU devices."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.io import checkpoint
from dlm_jax.config import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ModelConfig(name="mesh-gen", d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, mlp_hidden=64,
                   vocab_size=64, qkv_bias=True, mask_token_id=63, eos_token_id=1)
CONFIGS = {"llada": BASE.replace(rope_fp32=True), "dream": BASE.replace(logit_shift=1),
           "ar": BASE.replace(causal=True, logit_shift=1, mask_token_id=None)}


def _converted(tmp_path, sampler):
  directory = tmp_path / f"ckpt-{sampler}"
  checkpoint.save(directory, CONFIGS[sampler], model.init_params(CONFIGS[sampler], jax.random.key(0)))
  return directory


def _generate(directory, out_dir, mesh, sampler, extra=()):
  json_out, stats_out = out_dir / f"{sampler}-{mesh}.json", out_dir / f"{sampler}-{mesh}.npz"
  command = [sys.executable, "-m", "experiments.generate", f"--checkpoint={directory}", f"--sampler={sampler}",
             "--prompt_ids=5,9,12,7,30,2", "--gen_length=8", "--steps=8", "--block_length=4", "--cpu_devices=8",
             f"--mesh={mesh}", f"--json_out={json_out}", f"--stats_out={stats_out}", *extra]
  done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(json_out.read_text()), np.load(stats_out)["incoming_attention"]


@pytest.mark.parametrize("sampler, extra", [("llada", ("--mask_sinks=1",)), ("dream", ("--alg=entropy",)),
                                            ("ar", ()),
                                            ("llada", ("--mask_sinks=1", "--decoding=threshold_dual_cache",
                                                       "--threshold=0.5"))])
def test_same_outputs_under_every_mesh(tmp_path, sampler, extra):
  converted = _converted(tmp_path, sampler)
  reference, reference_stats = _generate(converted, tmp_path, "", sampler, extra)
  for mesh in ("data:8", "data:2,fsdp:2,tensor:2", "fsdp:2,tensor:4"):
    result, stats = _generate(converted, tmp_path, mesh, sampler, extra)
    assert result["tokens"] == reference["tokens"], mesh
    assert result["decode_step"] == reference["decode_step"], mesh
    np.testing.assert_allclose(stats, reference_stats, atol=1e-5, err_msg=mesh)
