"""The trajectory dataset format (`dlm_jax.io.trajectory_dataset`): NumPy-only reading, resume to the same bytes
after a kill, torn shards and other models refused in one line, batches, and `datasets` reading."""

import json
import os

import numpy as np
import pytest

from dlm_jax.io import trajectory_dataset as td

COLUMNS = {"step": ("int32", ()), "confidence": ("float32", ()), "blocks.0.hook_resid_post": ("float32", (4,))}
MODEL = {"config_sha256": "a" * 64, "weights_sha256": {"model.safetensors": "b" * 64}}
SETTINGS = {"steps": 8}


def _shard(k: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(k)
  n = 5 + k
  return {"step": np.arange(n, dtype=np.int32) + 10 * k, "confidence": rng.random(n, dtype=np.float32),
          "blocks.0.hook_resid_post": rng.standard_normal((n, 4), dtype=np.float32)}


def _writer(path, shards=3):
  return td.TrajectoryWriter(str(path), model=MODEL, settings=SETTINGS, columns=COLUMNS, expected_shards=shards)


def _export(path, stop_after=None):
  """Writes the 3 shards, raising inside the writer after shard `stop_after` (a kill)."""
  writer = _writer(path)
  for k in range(writer.shards_done, 3):
    writer.write_shard(k, _shard(k))
    if k == stop_after:
      raise KeyboardInterrupt("killed")
  return writer


def _files(path):
  out = {}
  for root, _, names in os.walk(path):
    for name in names:
      with open(os.path.join(root, name), "rb") as f:
        out[os.path.relpath(os.path.join(root, name), path)] = f.read()
  return out


def test_numpy_only_reading_matches_what_was_written(tmp_path):
  _export(tmp_path / "d")
  manifest = json.load(open(tmp_path / "d" / "manifest.json", encoding="utf-8"))
  # The documented NumPy-only snippet of the module docstring.
  cols = {c: np.concatenate([np.load(os.path.join(tmp_path / "d", "shards", f"{k:05d}", c + ".npy"), mmap_mode="r")
                             for k in range(len(manifest["shards"]))]) for c in manifest["columns"]}
  for name in COLUMNS:
    np.testing.assert_array_equal(cols[name], np.concatenate([_shard(k)[name] for k in range(3)]))
  ds = td.open_trajectory_dataset(str(tmp_path / "d"), expect_model=MODEL, verify=True)
  assert ds.num_rows == 5 + 6 + 7 and ds.columns == tuple(COLUMNS) and ds.manifest["complete"]
  np.testing.assert_array_equal(ds.column("blocks.0.hook_resid_post"), cols["blocks.0.hook_resid_post"])
  assert isinstance(ds.shard_column(1, "step"), np.memmap)


def test_iter_batches_in_order_and_shuffled(tmp_path):
  _export(tmp_path / "d")
  ds = td.open_trajectory_dataset(str(tmp_path / "d"))
  steps = ds.column("step")
  plain = list(ds.iter_batches(["step", "confidence"], 4))
  assert [len(b["step"]) for b in plain] == [4, 4, 4, 4, 2]
  np.testing.assert_array_equal(np.concatenate([b["step"] for b in plain]), steps)
  shuffled = np.concatenate([b["step"] for b in ds.iter_batches(["step"], 4, shuffle_seed=3)])
  np.testing.assert_array_equal(shuffled, steps[np.random.default_rng(3).permutation(len(steps))])
  assert sorted(shuffled) == sorted(steps)
  assert len(list(ds.iter_batches(["step"], 4, drop_last=True))) == 4


def test_column_view_reads_the_rows_it_is_asked_for(tmp_path):
  """A column seen as an array across shards: the rows at any indices (unsorted, repeated, across shards) equal
  the concatenated column's, and an SAE's batches read through it equal those read from the whole array."""
  from dlm_jax.training import sae_loop
  _export(tmp_path / "d")
  ds = td.open_trajectory_dataset(str(tmp_path / "d"))
  name = "blocks.0.hook_resid_post"
  whole, view = np.asarray(ds.column(name)), ds.column_view(name)
  assert view.shape == whole.shape == (18, 4) and view.ndim == 2 and view.dtype == np.float32
  indices = np.array([17, 0, 5, 5, 11, 4, 12])
  np.testing.assert_array_equal(view[indices], whole[indices])
  batches = sae_loop.ArrayBatches(view, 7, seed=1), sae_loop.ArrayBatches(whole, 7, seed=1)
  for step in range(4):  # past one epoch of 18 rows
    np.testing.assert_array_equal(batches[0].batch(step), batches[1].batch(step))


def test_killed_export_resumes_to_the_same_bytes(tmp_path):
  _export(tmp_path / "whole")
  with pytest.raises(KeyboardInterrupt):
    _export(tmp_path / "resumed", stop_after=1)
  # A leftover of a shard being written when the kill came is removed on resume.
  os.makedirs(tmp_path / "resumed" / "shards" / "00002")
  (tmp_path / "resumed" / "shards" / "00002" / "step.npy").write_bytes(b"torn")
  with pytest.raises(td.TrajectoryDatasetError, match="unfinished export .2 of 3 shards"):
    td.open_trajectory_dataset(str(tmp_path / "resumed"))
  assert _writer(tmp_path / "resumed").shards_done == 2
  _export(tmp_path / "resumed")
  assert _files(tmp_path / "resumed") == _files(tmp_path / "whole")


def test_torn_shard_other_model_and_bad_manifest_are_one_line(tmp_path):
  _export(tmp_path / "d")
  with pytest.raises(td.TrajectoryDatasetError, match="exported from another model") as error:
    td.open_trajectory_dataset(str(tmp_path / "d"), expect_model=dict(MODEL, config_sha256="c" * 64))
  assert "\n" not in str(error.value)
  with pytest.raises(td.TrajectoryDatasetError, match="other settings"):
    td.TrajectoryWriter(str(tmp_path / "d"), model=MODEL, settings={"steps": 9}, columns=COLUMNS, expected_shards=3)
  file = tmp_path / "d" / "shards" / "00001" / "confidence.npy"
  file.write_bytes(file.read_bytes()[:-3])
  with pytest.raises(td.TrajectoryDatasetError, match="confidence.npy is torn"):
    td.open_trajectory_dataset(str(tmp_path / "d"))
  (tmp_path / "d" / "manifest.json").write_text('{"format": "x"}', encoding="utf-8")
  with pytest.raises(td.TrajectoryDatasetError, match="expected format"):
    td.open_trajectory_dataset(str(tmp_path / "d"))
  with pytest.raises(td.TrajectoryDatasetError, match="no manifest.json"):
    td.open_trajectory_dataset(str(tmp_path))
  writer = _writer(tmp_path / "e")
  with pytest.raises(td.TrajectoryDatasetError, match="column confidence is <f8"):
    writer.write_shard(0, dict(_shard(0), confidence=np.zeros(5)))
  with pytest.raises(td.TrajectoryDatasetError, match="out of order"):
    writer.write_shard(1, _shard(1))
  _export(tmp_path / "f")
  with pytest.raises(td.TrajectoryDatasetError, match="no column 'x'"):
    td.open_trajectory_dataset(str(tmp_path / "f")).column("x")


def test_hugging_face_datasets_reads_the_shards(tmp_path):
  datasets = pytest.importorskip("datasets")
  _export(tmp_path / "d")
  path = str(tmp_path / "d")
  m = json.load(open(os.path.join(path, "manifest.json"), encoding="utf-8"))
  # The documented `datasets` snippet of the module docstring.
  parts = [datasets.Dataset.from_dict({c: np.load(os.path.join(path, "shards", f"{k:05d}", c + ".npy"))
                                       for c in m["columns"]}) for k in range(len(m["shards"]))]
  ds = datasets.concatenate_datasets(parts)
  assert len(ds) == 18
  np.testing.assert_allclose(np.asarray(ds["blocks.0.hook_resid_post"], np.float32),
                             np.concatenate([_shard(k)["blocks.0.hook_resid_post"] for k in range(3)]))
