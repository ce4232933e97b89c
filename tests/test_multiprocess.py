"""Real multi-process runs: two processes of 4 CPU devices each, joined by `jax.distributed` (Gloo
collectives), behave like one process — same tokens, statistics and trained weights as a single-device
run, and only process 0 writes."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from dlm_jax import model
from dlm_jax.io import checkpoint
from dlm_jax.config import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ModelConfig(name="multiprocess", d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, mlp_hidden=64,
                     vocab_size=64, rope_fp32=True, mask_token_id=63, eos_token_id=1)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_two_processes(module: str, per_process_args) -> None:
  """Runs `python -m module` as processes 0 and 1 of one jax.distributed job; per_process_args(i) -> argv."""
  address = f"localhost:{_free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, "-m", module, "--distributed=on", f"--coordinator_address={address}", "--num_processes=2",
       f"--process_id={i}", "--cpu_devices=4", *per_process_args(i)],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  outputs = []
  for proc in procs:
    try:
      outputs.append(proc.communicate(timeout=600))
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
  for i, (proc, (_, err)) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"process {i} failed:\n{err[-3000:]}"


def _run(module: str, args) -> None:
  done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                        check=False)
  assert done.returncode == 0, done.stderr[-3000:]


def test_generate_across_two_processes_equals_one_device(tmp_path):
  directory = tmp_path / "ckpt"
  checkpoint.save(directory, CONFIG, model.init_params(CONFIG, jax.random.key(0)))
  common = [f"--checkpoint={directory}", "--sampler=llada", "--prompt_ids=5,9,12,7,30,2", "--gen_length=8",
            "--steps=8", "--block_length=4", "--mask_sinks=1"]
  _run("experiments.generate", [*common, f"--json_out={tmp_path / 'one.json'}", f"--stats_out={tmp_path / 'one.npz'}"])
  _run_two_processes("experiments.generate", lambda i: [
      *common, "--mesh=data:2,fsdp:2,tensor:2", f"--json_out={tmp_path / f'two-{i}.json'}",
      f"--stats_out={tmp_path / f'two-{i}.npz'}"])
  assert not (tmp_path / "two-1.json").exists() and not (tmp_path / "two-1.npz").exists()
  one, two = json.loads((tmp_path / "one.json").read_text()), json.loads((tmp_path / "two-0.json").read_text())
  assert one["tokens"] == two["tokens"] and one["decode_step"] == two["decode_step"]
  np.testing.assert_allclose(np.load(tmp_path / "two-0.npz")["incoming_attention"],
                             np.load(tmp_path / "one.npz")["incoming_attention"], atol=1e-5)


def test_training_across_two_processes_equals_one_device(tmp_path):
  common = ["--preset=tiny-llada", "--objective=sft", "--train_size=64", "--eval_size=0", "--steps=3",
            "--batch_size=8", "--lr=3e-3", "--warmup=1", "--log_every=1", "--checkpoint_every=2"]
  _run("experiments.train", [*common, f"--out_dir={tmp_path / 'one'}"])
  _run_two_processes("experiments.train", lambda i: [
      *common, "--mesh=data:2,fsdp:2,tensor:2", f"--run_dir={tmp_path / 'run'}", f"--out_dir={tmp_path / f'two-{i}'}"])
  assert not (tmp_path / "two-1").exists()
  _, one = checkpoint.load(tmp_path / "one")
  _, two = checkpoint.load(tmp_path / "two-0")
  worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
              zip(jax.tree.leaves(one), jax.tree.leaves(two)))
  assert worst < 2e-5
  steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3]  # one writer: no line twice


@pytest.mark.parametrize("bad, message", [
    (["--num_processes=2"], "Give both num_processes and process_id"),
    (["--num_processes=2", "--process_id=2"], "process_id must be in [0, num_processes=2)"),
])
def test_incomplete_multiprocess_flags_are_refused(tmp_path, bad, message):
  done = subprocess.run([sys.executable, "-m", "experiments.train", "--preset=tiny-llada", "--steps=1",
                         "--distributed=on", "--coordinator_address=localhost:1", *bad],
                        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode != 0 and message in done.stderr
