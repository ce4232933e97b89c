"""A training run stopped mid-way and resumed ends with exactly the parameters of an uninterrupted run."""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from dlm_jax.training import data as training_data, loop as train_loop
from dlm_jax.config import preset
from dlm_jax.model import flatten_params
from dlm_jax.tasks import synthetic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _examples():
  tokenizer = synthetic.build_tokenizer()
  pairs = [(p.question, p.answer) for p in synthetic.make_split("train", 64, seed=0)]
  encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
  ids = training_data.SpecialIds(pad=0, bos=1, eos=2)
  return training_data.encode_examples(pairs, encode, "sft", ids, seq_len=68, prompt_len=36)


def _config():
  """What experiments/train.py builds from --preset=tiny-llada and the synthetic tokenizer."""
  return preset("tiny-llada").replace(vocab_size=len(synthetic.vocabulary()), mask_token_id=3, eos_token_id=2,
                                      bos_token_id=1, pad_token_id=0)


def test_stop_and_resume_equals_uninterrupted(tmp_path):
  config, examples = _config(), _examples()
  # 7 steps of 12 cross an epoch boundary (64 examples); the sink variant exercises the most state.
  tc = train_loop.TrainConfig(objective="sft", sink="front", sink_token_id=4, steps=7, batch_size=12, lr=3e-3,
                              warmup=2, checkpoint_every=2, log_every=0, seed=11, attention_impl="dense")
  full = train_loop.train(config, tc, examples, run_dir=str(tmp_path / "full"))
  assert full.step == 7 and not full.stopped_early and full.resumed_from is None

  first = train_loop.train(config, tc, examples, run_dir=str(tmp_path / "split"), stop_after=3)
  assert first.step == 3 and first.stopped_early
  second = train_loop.train(config, tc, examples, run_dir=str(tmp_path / "split"))
  assert second.resumed_from == 3 and second.step == 7
  jax.tree.map(np.testing.assert_array_equal, full.params, second.params)
  # Sanity: a run of a different length ends elsewhere.
  short = train_loop.train(config, tc, examples, run_dir=None, stop_after=6)
  assert not np.array_equal(short.params["lm_head"]["kernel"], full.params["lm_head"]["kernel"])


def test_resume_refuses_another_configuration(tmp_path):
  config, examples = _config(), _examples()
  tc = train_loop.TrainConfig(objective="sft", steps=2, batch_size=4, log_every=0, attention_impl="dense")
  train_loop.train(config, tc, examples, run_dir=str(tmp_path), stop_after=1)
  with pytest.raises(ValueError, match="another configuration"):
    train_loop.train(config, dataclasses.replace(tc, lr=5e-4), examples, run_dir=str(tmp_path))


def _train_command(run_dir, out_dir, steps):
  return [sys.executable, "-m", "experiments.train", "--preset=tiny-llada", "--objective=sft", "--data=synthetic",
          "--train_size=64", "--eval_size=0", f"--steps={steps}", "--batch_size=4", "--lr=3e-3", "--warmup=2",
          "--checkpoint_every=25", "--log_every=25", "--attention_impl=dense", f"--run_dir={run_dir}", f"--out_dir={out_dir}"]


def _env():
  """The child's JAX settings mirror this process's (device count and precision change reduction order)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
         "JAX_NUM_CPU_DEVICES": str(jax.config.jax_num_cpu_devices)}
  if jax.config.jax_default_matmul_precision:
    env["JAX_DEFAULT_MATMUL_PRECISION"] = str(jax.config.jax_default_matmul_precision)
  return env


def _run(command):
  env = _env()
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=True)


def test_killed_subprocess_resumes_to_the_same_weights(tmp_path):
  """SIGKILL experiments/train.py after its first checkpoint, start it again, compare with a clean run
  (in-process, with the configuration the command line builds)."""
  steps = 100
  env = _env()
  process = subprocess.Popen(_train_command(tmp_path / "killed", tmp_path / "killed_out", steps), cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  checkpoints = tmp_path / "killed" / "checkpoints"
  deadline = time.time() + 240
  while time.time() < deadline and process.poll() is None:
    if checkpoints.exists() and any(p.name.isdigit() for p in checkpoints.iterdir()):
      break
    time.sleep(0.02)
  assert process.poll() is None, "the run ended before it could be killed"
  process.send_signal(signal.SIGKILL)
  process.wait()
  saved = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
  assert saved and saved[-1] < steps and not (tmp_path / "killed_out").exists()
  resumed = _run(_train_command(tmp_path / "killed", tmp_path / "killed_out", steps))
  assert f"resumed from step {saved[-1]}" in resumed.stderr
  tc = train_loop.TrainConfig(objective="sft", steps=steps, batch_size=4, lr=3e-3, warmup=2, log_every=0,
                              attention_impl="dense")
  clean = flatten_params(train_loop.train(_config(), tc, _examples()).params)
  config, params = train_loop.load_converted(str(tmp_path / "killed_out"))
  assert config == _config()
  again = flatten_params(params)
  assert clean.keys() == again.keys()
  for name in clean:
    np.testing.assert_array_equal(clean[name], again[name], err_msg=name)
