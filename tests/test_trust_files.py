"""Nothing destroyed or mixed: converters never write into, over or above their source (links resolved),
temporary work is cleaned up, results files are validated line by line, an output directory is locked by
its run, and run.json identifies weights by content."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import save_file

from converters.hf_convert import convert
from dlm_jax.io.errors import CheckpointError
from dlm_jax.io.output_dir import atomic_output_dir, clean_stale
from experiments.common import checkpoints, results_file, run_dir, weight_hashes
from experiments.common.cli import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, F, V, L = 8, 16, 32, 1


def _llama_dir(path) -> str:
  """A minimal Hugging Face Llama checkpoint (random float32 weights)."""
  os.makedirs(path)
  config = {"model_type": "llama", "hidden_size": D, "num_hidden_layers": L, "num_attention_heads": 2,
            "num_key_value_heads": 2, "intermediate_size": F, "vocab_size": V, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  rng = np.random.default_rng(0)
  shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
  for l in range(L):
    p = f"model.layers.{l}."
    shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "self_attn.q_proj.weight": (D, D), p + "self_attn.k_proj.weight": (D, D),
                   p + "self_attn.v_proj.weight": (D, D), p + "self_attn.o_proj.weight": (D, D),
                   p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                   p + "mlp.down_proj.weight": (D, F)})
  save_file({n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()},
            os.path.join(path, "model.safetensors"))
  return str(path)


def _snapshot(directory) -> dict[str, bytes]:
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      with open(os.path.join(root, name), "rb") as f:
        out[os.path.relpath(os.path.join(root, name), directory)] = f.read()
  return out


def _hidden(parent) -> list[str]:
  return sorted(n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n)


@pytest.mark.parametrize("where", ["same", "parent", "inside", "link_to_source", "link_to_parent"])
def test_convert_never_writes_into_over_or_above_its_source(tmp_path, where):
  hf = _llama_dir(tmp_path / "ckpt" / "hf")
  before = _snapshot(tmp_path / "ckpt")
  out = {"same": hf, "parent": str(tmp_path / "ckpt"), "inside": os.path.join(hf, "converted"),
         "link_to_source": str(tmp_path / "link"), "link_to_parent": str(tmp_path / "link")}[where]
  if where.startswith("link"):
    os.symlink(hf if where == "link_to_source" else str(tmp_path / "ckpt"), out)
  with pytest.raises(CheckpointError, match="input"):
    convert(hf, out, overwrite=True)
  assert _snapshot(tmp_path / "ckpt") == before
  assert _hidden(tmp_path) == _hidden(tmp_path / "ckpt") == []


def test_convert_through_a_symlinked_out_dir_writes_the_target(tmp_path):
  hf = _llama_dir(tmp_path / "hf")
  target = tmp_path / "real"
  target.mkdir()
  (target / "stale.txt").write_text("old output")
  link = tmp_path / "link"
  os.symlink(target, link)
  convert(hf, str(link), overwrite=True)
  assert os.path.islink(link) and os.path.realpath(link) == str(target)
  assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]
  assert _hidden(tmp_path) == []


def test_stale_temporary_work_is_removed_by_the_next_run(tmp_path):
  out = tmp_path / "out"
  script = textwrap.dedent(f"""
      import os, signal
      from dlm_jax.io.output_dir import atomic_output_dir
      with atomic_output_dir({str(out)!r}) as tmp:
        open(os.path.join(tmp, "half"), "w").write("x")
        os.kill(os.getpid(), signal.SIGKILL)
      """)
  killed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
  assert killed.returncode == -signal.SIGKILL, killed.stderr
  left = _hidden(tmp_path)
  assert len(left) == 1 and left[0].startswith(".out.tmp-") and not out.exists()
  mine = tmp_path / f".out.tmp-{left[0].split('-')[1]}-{os.getpid()}-00000000"  # a live process's: kept
  mine.mkdir()
  other_host = tmp_path / ".out.old-otherhost-1-00000000"  # another host's: kept
  other_host.mkdir()
  assert clean_stale(out) == [str(tmp_path / left[0])]
  with atomic_output_dir(out) as tmp:
    open(os.path.join(tmp, "done"), "w").write("y")
  assert sorted(os.listdir(tmp_path)) == sorted([mine.name, other_host.name, "out"])


# -------------------------------------------------------------------------------------------------------
# Results files.

GOOD = b'{"item": "0", "x": 1}\n{"item": "1", "x": 2}\n'


@pytest.mark.parametrize("bad, line", [
    (b'garbage\n', 2),
    (b'[1, 2]\n', 2),
    (b'{"item": "\xff"}\n', 2),
    (b'{"x": 3}\n', 2),  # no key field
])
def test_results_bad_line_in_the_middle_is_refused_and_nothing_deleted(tmp_path, bad, line):
  path = tmp_path / "r.jsonl"
  data = GOOD[:22] + bad + GOOD[22:]
  path.write_bytes(data)
  with pytest.raises(UserError, match=rf"r\.jsonl:{line}\b"):
    results_file.read(str(path), ("item",))
  out = run_dir.RunDir(str(tmp_path / "run"), {"a": 1})
  out.ensure()
  (tmp_path / "run" / "r.jsonl").write_bytes(data)
  with pytest.raises(UserError, match=rf"r\.jsonl:{line}\b.*nothing was changed"):
    run_dir.ResultsLog(run_dir.RunDir(str(tmp_path / "run"), {"a": 1}), "r.jsonl", ("item",))
  assert (tmp_path / "run" / "r.jsonl").read_bytes() == data


def test_results_torn_last_line_dropped_complete_last_line_kept(tmp_path):
  out = run_dir.RunDir(str(tmp_path / "run"), {"a": 1})
  out.ensure()
  path = tmp_path / "run" / "r.jsonl"
  path.write_bytes(GOOD + b'{"item": "2", "x"')
  log = run_dir.ResultsLog(run_dir.RunDir(str(tmp_path / "run"), {"a": 1}), "r.jsonl", ("item",))
  assert [r["x"] for r in log.records] == [1, 2] and path.read_bytes() == GOOD
  path.write_bytes(GOOD + b'{"item": "2", "x": 3}')
  log = run_dir.ResultsLog(run_dir.RunDir(str(tmp_path / "run"), {"a": 1}), "r.jsonl", ("item",))
  log.append({"item": "3", "x": 4})
  assert [json.loads(l)["x"] for l in path.read_bytes().splitlines()] == [1, 2, 3, 4]
  for last in (b'[1, 2]', b'garbage', b'{"item": "\xff"}'):  # no newline, but not a torn object line: refused
    with pytest.raises(UserError, match=r"r\.jsonl:3\b"):
      results_file.parse(GOOD + last, "r.jsonl", ("item",))


_HOLD_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "w")
fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_process_on_one_output_dir_is_refused(tmp_path):
  out = run_dir.RunDir(str(tmp_path / "run"), {"a": 1})
  out.ensure()
  lock_path = str(tmp_path / "run" / run_dir.LOCK_FILE)
  os.close(run_dir._LOCKS.pop(os.path.realpath(tmp_path / "run")))  # pylint: disable=protected-access  (now another run)
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, lock_path], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(UserError, match="in use by another process"):
      run_dir.RunDir(str(tmp_path / "run"), {"a": 1})
    with pytest.raises(UserError, match="in use by another process"):
      run_dir.RunDir(str(tmp_path / "run"), {"a": 1}, overwrite=True)
  finally:
    holder.kill()
    holder.wait()
  assert run_dir.RunDir(str(tmp_path / "run"), {"a": 1}).resumed


# -------------------------------------------------------------------------------------------------------
# Weights identified by content.


def test_weights_identified_by_content_and_hashes_cached_outside_the_checkpoint(tmp_path, monkeypatch):
  monkeypatch.setenv("DLM_JAX_CACHE", str(tmp_path / "cache"))
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "config.json").write_text("{}")
  weights = ckpt / "model.safetensors"
  weights.write_bytes(b"\x01" * 1000)
  first = checkpoints.identity(str(ckpt))
  assert first["weights_sha256"] == {"model.safetensors": hashlib.sha256(b"\x01" * 1000).hexdigest()}
  assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors"]
  assert os.path.isfile(tmp_path / "cache" / weight_hashes.CACHE_NAME)
  calls = []
  real_hash = weight_hashes.file_sha256
  monkeypatch.setattr(weight_hashes, "file_sha256", lambda p: calls.append(p) or real_hash(p))
  assert checkpoints.identity(str(ckpt)) == first and calls == []  # a resume reads nothing
  stat = os.stat(weights)
  weights.write_bytes(b"\x02" * 1000)  # same size, other content
  os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  second = checkpoints.identity(str(ckpt))
  assert len(calls) == 1 and second["weights_sha256"] != first["weights_sha256"]
  out = run_dir.RunDir(str(tmp_path / "run"), {"checkpoints": {"m": first}})
  out.ensure()
  with pytest.raises(UserError, match=r"checkpoints\.m\.weights_sha256\.model\.safetensors"):
    run_dir.RunDir(str(tmp_path / "run"), {"checkpoints": {"m": second}})


def test_old_run_json_with_weight_sizes_gets_a_clear_message(tmp_path, monkeypatch):
  monkeypatch.setenv("DLM_JAX_CACHE", str(tmp_path / "cache"))
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "config.json").write_text("{}")
  (ckpt / "model.safetensors").write_bytes(b"\x01" * 10)
  new = checkpoints.identity(str(ckpt))
  old = {k: v for k, v in new.items() if k != "weights_sha256"} | {"weights": {"model.safetensors": 10}}
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "run.json").write_text(json.dumps({"checkpoints": {"m": old}}))
  with pytest.raises(UserError, match="identifies the checkpoint weights by file size.*--overwrite"):
    run_dir.RunDir(str(tmp_path / "run"), {"checkpoints": {"m": new}})


def test_run_dir_never_over_or_inside_its_inputs(tmp_path):
  ckpt = tmp_path / "models" / "ckpt"
  ckpt.mkdir(parents=True)
  (ckpt / "config.json").write_text("{}")
  task = tmp_path / "task.jsonl"
  task.write_text("")
  for out, inputs in ((tmp_path / "models", [str(ckpt)]), (ckpt, [str(ckpt)]), (ckpt / "results", [str(ckpt)]),
                      (tmp_path, [str(task)])):
    with pytest.raises(CheckpointError, match="input"):
      run_dir.RunDir(str(out), {"a": 1}, overwrite=True, inputs=inputs)
  assert (ckpt / "config.json").read_text() == "{}" and task.exists()
  assert not (tmp_path / run_dir.LOCK_FILE).exists() and not (ckpt / run_dir.LOCK_FILE).exists()
  run_dir.RunDir(str(tmp_path / "results"), {"a": 1}, overwrite=True, inputs=[str(ckpt), str(task)])


def test_weight_hashes_without_a_writable_cache(tmp_path, monkeypatch):
  (tmp_path / "a_file").write_text("x")
  monkeypatch.setenv("DLM_JAX_CACHE", str(tmp_path / "a_file" / "cache"))  # cannot be created
  (tmp_path / "w.safetensors").write_bytes(b"abc")
  assert weight_hashes.sha256([str(tmp_path / "w.safetensors")]) == {
      str(tmp_path / "w.safetensors"): hashlib.sha256(b"abc").hexdigest()}
