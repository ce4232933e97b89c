"""Per-item results do not depend on the batch: the same items at batch sizes 1 and 3 (so item 3 shares
its batch with nobody in one run and the items of different lengths share batches in the other) give the
same tokens, completions and sinks, and statistics equal up to float32 rounding, for LLaDA, Dream and an
ARM with left-padded prompts of different lengths; and at temperature > 0 each item's sample comes from
its own PRNG key (seed and item id)."""


import jax
import numpy as np

from experiments.common import decoding

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

EXACT = ("completion", "score_histogram", "n_entries", "nonsink_counts", "token_counts", "sink_fraction",
         "largest_at_first_token", "largest_in_prompt", "steps", "prompt_length", "first_real_position")


def _run(tmp_path, entries, batch_size):
  out = tmp_path / f"b{batch_size}"
  fx.run_binary("sink_analysis", f"--checkpoints={entries}", "--samplers=llada,dream,ar", f"--output_dir={out}",
                "--n_prompts=4", f"--batch_size={batch_size}", "--gen_length=8", "--steps=8", "--block_length=4",
                "--prompt_format=plain", "--task=simple", "--figure_item=3")
  return out, {(r["model"], r["item"]): r for r in fx.read_jsonl(out / "results.jsonl")}


def test_same_items_at_two_batch_sizes(tmp_path):
  root = tmp_path / "ckpt"
  entries = ",".join(f"{kind}={fx.tiny_checkpoint(str(root / kind), kind, seed=i)}"
                     for i, kind in enumerate(("dlm", "dream", "arm")))
  out1, one = _run(tmp_path, entries, 1)
  out3, three = _run(tmp_path, entries, 3)
  assert one.keys() == three.keys() and len(one) == 12
  lengths = {r["first_real_position"] for r in three.values()}
  assert len(lengths) > 1  # the prompts really are padded by different amounts
  for key, a in one.items():
    b = three[key]
    for field in EXACT:
      assert a[field] == b[field], (key, field)
    np.testing.assert_allclose(a["main_sink_grid"], b["main_sink_grid"], rtol=1e-5, atol=1e-5, err_msg=str(key))
    np.testing.assert_allclose(a["first_token_share"], b["first_token_share"], rtol=1e-5, atol=1e-6)
  for model in ("dlm", "dream", "arm"):
    with np.load(out1 / model / "item_3.npz") as a, np.load(out3 / model / "item_3.npz") as b:
      for name in ("tokens", "decode_step", "largest", "valid"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"{model} {name}")
      np.testing.assert_allclose(a["layer_scores"], b["layer_scores"], rtol=1e-5, atol=1e-5)


def test_item_keys_come_from_the_seed_and_the_id():
  key = lambda seed, item: np.asarray(jax.random.key_data(decoding.item_key(seed, item)))
  np.testing.assert_array_equal(key(0, "7"), key(0, "7"))
  assert not np.array_equal(key(0, "7"), key(0, "8")) and not np.array_equal(key(0, "7"), key(1, "7"))
  rows = np.asarray(jax.random.key_data(decoding.batch_key(0, ["7", "8"])))  # one key per row: its item's
  np.testing.assert_array_equal(rows, np.stack([key(0, "7"), key(0, "8")]))


def test_sampled_items_do_not_depend_on_the_batch(tmp_path):
  """At temperature > 0 an item's sample comes from its own key: the same at batch sizes 1 and 3."""
  dlm = fx.tiny_checkpoint(str(tmp_path / "dlm"), "dlm", seed=2)
  runs = []
  for batch_size in (1, 3):
    out = tmp_path / f"t{batch_size}"
    fx.run_binary("sink_masking_eval", f"--checkpoints=dlm={dlm}", f"--output_dir={out}", "--n_items=4",
                  f"--batch_size={batch_size}", "--gen_length=8", "--steps=8", "--block_length=4", "--mask_top_k=0",
                  "--temperature=1.5", "--prompt_format=plain", "--task=simple")
    runs.append({r["item"]: r["completion_ids"] for r in fx.read_jsonl(out / "results.jsonl")})
  assert runs[0] == runs[1] and len(runs[0]) == 4
