"""experiments.generate gives the same tokens and statistics under every mesh of 8 CPU devices."""

import json

import jax
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.io import checkpoint
from dlm_jax.config import ModelConfig

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

BASE = ModelConfig(name="mesh-gen", d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, mlp_hidden=64,
                   vocab_size=64, qkv_bias=True, mask_token_id=63, eos_token_id=1)
CONFIGS = {"llada": BASE.replace(rope_fp32=True), "dream": BASE.replace(logit_shift=1),
           "ar": BASE.replace(causal=True, logit_shift=1, mask_token_id=None)}
MESHES = ("", "data:8", "data:2,fsdp:2,tensor:2", "fsdp:2,tensor:4")
CASES = [("llada", ("--mask_sinks=1",)), ("dream", ("--alg=entropy",)), ("ar", ()),
         ("llada", ("--mask_sinks=1", "--decoding=threshold_dual_cache", "--threshold=0.5"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """{(case index, mesh): (JSON result, incoming attention)}: every case under every mesh ("" = none), run by
  experiments.generate with --cpu_devices=8 in one process (`experiments_fixtures.run_modules`)."""
  root = tmp_path_factory.mktemp("generate_mesh")
  directories = {}
  for sampler, config in CONFIGS.items():
    directories[sampler] = root / f"ckpt-{sampler}"
    checkpoint.save(directories[sampler], config, model.init_params(config, jax.random.key(0)))
  keys, flag_lists = [], []  # one process: the compiled programs one mesh shares with another are compiled once
  for index, (sampler, extra) in enumerate(CASES):
    for mesh in MESHES:
      out = root / f"{index}-{mesh}"
      keys.append((index, mesh, out.with_name(f"{out.name}.json"), out.with_name(f"{out.name}.npz")))
      flag_lists.append([f"--checkpoint={directories[sampler]}", f"--sampler={sampler}", "--prompt_ids=5,9,12,7,30,2",
                         "--gen_length=8", "--steps=8", "--block_length=4", "--cpu_devices=8", f"--mesh={mesh}",
                         f"--json_out={out}.json", f"--stats_out={out}.npz", *extra])
  done = fx.run_modules([("experiments.generate", flags) for flags in flag_lists])
  results = {}
  for (index, mesh, json_out, stats_out), (code, stderr, _) in zip(keys, done):
    assert code in (0, None), (index, mesh, stderr[-3000:])
    with np.load(stats_out) as stats:
      results[index, mesh] = json.loads(json_out.read_text()), stats["incoming_attention"]
  return results


@pytest.mark.parametrize("index", range(len(CASES)), ids=["llada-mask_sinks", "dream-entropy", "ar",
                                                          "llada-threshold_dual_cache"])
def test_same_outputs_under_every_mesh(runs, index):
  reference, reference_stats = runs[index, ""]
  for mesh in MESHES[1:]:
    result, stats = runs[index, mesh]
    assert result["tokens"] == reference["tokens"], mesh
    assert result["decode_step"] == reference["decode_step"], mesh
    np.testing.assert_allclose(stats, reference_stats, atol=1e-5, err_msg=mesh)
