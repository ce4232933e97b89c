"""experiments.sink_masking_eval end to end on tiny random checkpoints: the table, an interrupted run that
resumes to the same table, an item recomputed independently, a mesh run; and the resumable JSONL log."""

import json

import numpy as np
import pytest

from dlm_jax.instrument import interventions
from dlm_jax.io import checkpoint
from dlm_jax.sampling import llada
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

COMMON_FLAGS = ("--n_items=5", "--batch_size=2", "--gen_length=8", "--steps=8", "--block_length=4",
                "--mask_top_k=0,1,5", "--perplexity_items=3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("masking_ckpt")
  return {"dlm": fx.tiny_checkpoint(str(root / "dlm"), "dlm", seed=3),
          "arm": fx.tiny_checkpoint(str(root / "arm"), "arm", seed=4)}


def _flags(checkpoints, out, *extra):
  return [f"--checkpoints=dlm={checkpoints['dlm']},arm={checkpoints['arm']}", f"--output_dir={out}", *COMMON_FLAGS,
          *extra]


def _run(checkpoints, *runs):
  """Runs sink_masking_eval once per (output directory, extra flags...) in one process (`run_modules`, INFO
  lines shown as under `python -m`); returns (stdout, stderr) per run, each having exited 0."""
  done = fx.run_modules([("experiments.sink_masking_eval", _flags(checkpoints, *run)) for run in runs],
                        show_info=True)
  for code, stderr, _ in done:
    assert code in (0, None), stderr[-6000:]
  return [(stdout, stderr) for _, stderr, stdout in done]


@pytest.fixture(scope="module")
def full_run(checkpoints, tmp_path_factory):
  """The full run, and in the same process the first part (7 items) of the interrupted run resumed below."""
  out, interrupted = tmp_path_factory.mktemp("masking_full"), tmp_path_factory.mktemp("masking_interrupted")
  (stdout, _), _ = _run(checkpoints, (out,), (interrupted / "out", "--max_items_this_run=7"))
  return out, stdout, interrupted / "out"


def test_table_and_outputs(full_run):
  out, stdout, _ = full_run
  assert "no masking" in stdout and "top-5 masked" in stdout
  table = json.loads((out / "table.json").read_text())
  records = fx.read_jsonl(out / "results.jsonl")
  for model in ("dlm", "arm"):
    for k in ("0", "1", "5"):
      cell = table["accuracy"][model][k]
      rows = [r for r in records if r["kind"] == "accuracy" and r["model"] == model and str(r["condition"]) == k]
      assert cell["n"] == len(rows) == 5
      p = np.mean([r["correct"] for r in rows])
      assert cell["accuracy"] == pytest.approx(p)
      assert cell["se"] == pytest.approx(np.sqrt(p * (1 - p) / 5))
  ppl = table["perplexity"]["arm"]
  assert set(ppl) == {"none", "first", "top1_static", "top5_static"}
  assert all(v["perplexity"] > 1 and v["n_texts"] == 3 for v in ppl.values())
  assert "dlm" not in table["perplexity"]
  for name in ("table.md", "summary.md", "masking_accuracy.png", "run.json"):
    assert (out / name).stat().st_size > 0
  keys = [(r["kind"], r["model"], r["condition"], r["item"]) for r in records]
  assert len(keys) == len(set(keys)) == 2 * 3 * 5 + 4 * 3


def test_interrupted_run_resumes_to_the_same_table(full_run, checkpoints):
  out_full, _, out = full_run  # stopped after 7 items
  assert not (out / "table.json").exists()
  first = fx.read_jsonl(out / "results.jsonl")
  assert len(first) == 7
  with open(out / "results.jsonl", "a", encoding="utf-8") as f:  # a line torn by a crash
    f.write('{"kind": "accuracy", "model": "dlm", "condi')
  _run(checkpoints, (out, "--max_items_this_run=9"))
  assert len(fx.read_jsonl(out / "results.jsonl")) == 16
  [(_, stderr)] = _run(checkpoints, (out,))
  assert "resuming" in stderr
  resumed = json.loads((out / "table.json").read_text())
  full = json.loads((out_full / "table.json").read_text())
  assert resumed["accuracy"] == full["accuracy"]
  for model in full["perplexity"]:
    for c, v in full["perplexity"][model].items():
      assert resumed["perplexity"][model][c]["perplexity"] == pytest.approx(v["perplexity"], rel=1e-6)
  by_key = lambda rows: {(r["kind"], r["model"], r["condition"], r["item"]): r for r in rows}
  a, b = by_key(fx.read_jsonl(out_full / "results.jsonl")), by_key(fx.read_jsonl(out / "results.jsonl"))
  assert a.keys() == b.keys()
  for key, row in a.items():
    if key[0] == "accuracy":
      assert row["completion_ids"] == b[key]["completion_ids"], key


def test_item_recomputed_independently(full_run, checkpoints):
  """A DLM item of the table decoded again, alone, with MaskPreviousSinks(top_k=K) through llada.generate."""
  out, _, _ = full_run
  records = [r for r in fx.read_jsonl(out / "results.jsonl") if r["kind"] == "accuracy" and r["model"] == "dlm"]
  config, params = checkpoint.load(checkpoints["dlm"])
  options = llada.LLaDAOptions(gen_length=8, steps=8, block_length=4)
  for r in [x for x in records if x["item"] in ("0", "4") and x["condition"] in (1, 5)]:
    trace = llada.generate(params, np.asarray([r["prompt_ids"]], np.int32), config=config, options=options,
                           setup=RunSetup(intervention=interventions.MaskPreviousSinks(top_k=r["condition"])))
    row = [int(t) for t in np.asarray(trace.generated)[0]]
    stop = next((i for i, t in enumerate(row) if t in (config.eos_token_id, config.pad_token_id)), len(row))
    assert row[:stop] == r["completion_ids"], r["item"]


def test_arm_item_recomputed_without_padding(full_run, checkpoints):
  """An ARM item decoded alone from its unpadded prompt with MaskPreviousSinksAR(top_k=K, last row)."""
  from dlm_jax.sampling import autoregressive
  out, _, _ = full_run
  records = [r for r in fx.read_jsonl(out / "results.jsonl") if r["kind"] == "accuracy" and r["model"] == "arm"]
  config, params = checkpoint.load(checkpoints["arm"])
  for r in [x for x in records if x["item"] in ("1", "4") and x["condition"] in (0, 5)]:
    intervention = interventions.MaskPreviousSinksAR(top_k=r["condition"], last_row_weights=True)
    trace = autoregressive.generate(params, np.asarray([r["prompt_ids"]], np.int32), config=config,
                                    options=autoregressive.AROptions(gen_length=8, stop_at_eos=True),
                                    setup=RunSetup(intervention=intervention))
    row = [int(t) for t in np.asarray(trace.generated)[0]]
    stop = next((i for i, t in enumerate(row) if t in (config.eos_token_id, config.pad_token_id)), len(row))
    assert row[:stop] == r["completion_ids"], r["item"]


def test_mesh_run(checkpoints, tmp_path):
  out = tmp_path / "mesh"
  fx.run_binary("sink_masking_eval", f"--checkpoints=dlm={checkpoints['dlm']},arm={checkpoints['arm']}",
                f"--output_dir={out}", "--n_items=5", "--batch_size=3", "--gen_length=8", "--steps=8",
                "--block_length=4", "--mask_top_k=0,1", "--perplexity_items=3", "--cpu_devices=8",
                "--mesh=data:2,fsdp:2,tensor:2")
  table = json.loads((out / "table.json").read_text())
  assert all(table["accuracy"][m][k]["n"] == 5 for m in ("dlm", "arm") for k in ("0", "1"))


def test_results_log_skips_torn_lines_and_duplicates(tmp_path):
  from experiments.common import run_dir
  out = run_dir.RunDir(str(tmp_path / "run"), {"a": 1})
  assert not (tmp_path / "run").exists()  # nothing before the first result
  log = run_dir.ResultsLog(out, "r.jsonl", ("model", "item"))
  assert log.append({"model": "a", "item": "0", "x": 1})
  assert not log.append({"model": "a", "item": "0", "x": 2})  # duplicate key: ignored
  assert (tmp_path / "run" / "run.json").exists()
  with open(out.file("r.jsonl"), "a", encoding="utf-8") as f:
    f.write('{"model": "a", "it')
  again = run_dir.ResultsLog(run_dir.RunDir(str(tmp_path / "run"), {"a": 1}), "r.jsonl", ("model", "item"), budget=2)
  assert [r["x"] for r in again.records] == [1] and again.done(model="a", item="0")
  again.append({"model": "a", "item": "1", "x": 3})
  with pytest.raises(run_dir.ItemBudget):
    again.append({"model": "a", "item": "2", "x": 4})
  assert [json.loads(line)["x"] for line in open(out.file("r.jsonl"), encoding="utf-8")] == [1, 3, 4]


def test_run_dir_names_the_differing_settings(tmp_path):
  from experiments.common import cli, run_dir
  out = run_dir.RunDir(str(tmp_path / "run"), {"settings": {"numerics": {"dtype": "float32"}, "n": 2}})
  out.ensure()
  with pytest.raises(cli.UserError, match=r"\(settings\.numerics\.dtype\)"):
    run_dir.RunDir(str(tmp_path / "run"), {"settings": {"numerics": {"dtype": "bfloat16"}, "n": 2}})
  run_dir.RunDir(str(tmp_path / "run"), {"settings": {"numerics": {"dtype": "bfloat16"}, "n": 2}}, overwrite=True)
  assert (tmp_path / "run" / "run.json").exists()  # --overwrite replaces the old run only at the first write


def test_batches_and_padding():
  from experiments.common import item_batches
  assert item_batches.fixed_batches(5, 2) == [[0, 1], [2, 3], [4]]
  padded = item_batches.pad_rows(np.arange(6).reshape(3, 2), 4)
  np.testing.assert_array_equal(padded, [[0, 1], [2, 3], [4, 5], [4, 5]])


def test_perplexity_conditions_against_plain_forward():
  """'none' is the plain forward's NLL, right padding changes nothing, and masking key 0 through the
  shared and the per-(layer, head) path agree."""
  import jax
  import jax.numpy as jnp
  from dlm_jax import model
  from dlm_jax.config import preset
  from dlm_jax.analysis import perplexity
  config = preset("tiny-llama")
  params = model.init_params(config, jax.random.key(7))
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, config.vocab_size, (2, 12)).astype(np.int32)
  real = np.ones((2, 12), bool)
  real[1, 9:] = False  # row 1: 9 real tokens, right-padded
  out = perplexity.perplexity_conditions(params, tokens, real, [1, 3], config=config)
  logits = model.forward(params, jnp.asarray(tokens), config=config).logits
  logp = jax.nn.log_softmax(logits[:, :-1], -1)
  ce = -np.take_along_axis(np.asarray(logp), tokens[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(out["none"], (ce * real[:, 1:]).sum(1), rtol=1e-5)
  alone = perplexity.perplexity_conditions(params, tokens[1:, :9], real[1:, :9], [1], config=config)
  for name in ("none", "first", "top1_static"):
    np.testing.assert_allclose(out[name][1], alone[name][0], rtol=1e-5)
  all_heads = jnp.zeros((config.n_layers, 2, config.n_heads, 12), bool).at[..., 0].set(True)
  per_head = perplexity.masked_pass(params, jnp.asarray(tokens), jnp.asarray(real), all_heads, config=config,
                                    per_head=True)
  np.testing.assert_allclose(out["first"], np.asarray(per_head), rtol=1e-5)
  assert not np.allclose(out["first"], out["none"])
