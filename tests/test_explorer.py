"""The decoding explorer in a real headless browser (Debian's chromium): the page of one small sink_analysis run
under a compute policy (built once for the module, with --html) plus a sink_masking_eval run, checked against the
run's own files — tokens, step count and each position's state in the DOM, screenshots at two slider positions
that differ exactly where the trace says the canvas changed, no script errors, no network — and the policy's
computed queries and kept keys on the page against the `Trace` the run decoded (recorded in the test's process)."""

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from experiments.reports import explorer_page

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WINDOW = (1280, 1400)


SPARSE_POLICY = "sparse_dllm:keep_ratio=0.25"

_POLICY_RUNS = r"""
import json, sys
import numpy as np
from absl import flags
from experiments import sink_analysis
from experiments.common import cli, decoding
generate, saved = decoding.generate, None

def recording(*args, **kwargs):  # the run's one batch: its Trace's policy entries, as the library made them
  trace = generate(*args, **kwargs)
  arrays = {"computed": trace.computed_positions, "keys_read": trace.keys_read}
  record = trace.policy_record
  if isinstance(record, dict):  # dKV-Cache's {"rows": ...}, d2Cache's, Elastic-Cache's: one array per entry
    arrays.update({f"record_{k}": v for k, v in record.items()})
  elif record is not None:
    arrays["record"] = record
  np.savez(saved, **{k: np.asarray(v) for k, v in arrays.items()})
  return trace

decoding.generate = recording
for saved, args in json.loads(sys.argv[1]):
  flags.FLAGS.unparse_flags()
  cli.call(sink_analysis.main, flags.FLAGS(["experiments.sink_analysis"] + args))
"""


def _policy_runs(runs: list[tuple[str, list[str]]]) -> None:
  """sink_analysis runs (trace file, flags) in one CPU process, each batch's Trace recorded to its trace file."""
  done = subprocess.run([sys.executable, "-c", _POLICY_RUNS, json.dumps(runs)], cwd=fx.ROOT, capture_output=True,
                        text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
  assert done.returncode == 0, done.stderr[-6000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """Two tiny-dlm sink_analysis runs of one batch of 2 prompts under compute policies (Sparse-dLLM with --html,
  dKV-Cache), their Traces, and one sink_masking_eval run of the same items."""
  root = tmp_path_factory.mktemp("explorer")
  analysis, masking, dkv = root / "analysis", root / "masking", root / "dkv"
  common = ["--checkpoints=tiny-dlm", "--n_prompts=2", "--batch_size=2"]
  _policy_runs([(str(root / "sparse_trace.npz"), [*common, "--html", f"--policy={SPARSE_POLICY}",
                                                  f"--output_dir={analysis}"]),
                (str(root / "dkv_trace.npz"), [*common, "--policy=dkv_cache", f"--output_dir={dkv}"])])
  fx.run_binary("sink_masking_eval", "--checkpoints=tiny-dlm", "--n_items=2", "--batch_size=2", "--mask_top_k=0,1",
                f"--output_dir={masking}")
  (analysis / "captures").mkdir()
  (analysis / "captures" / "lens.json").write_text(json.dumps(
      {"title": "A later capture", "kind": "grid", "rows": ["layer 0", "layer 1"], "cols": ["a", "b", "c"],
       "values": [[0.1, 0.2, 0.3], [0.4, 0.5, 0.625]], "note": "a grid panel"}))
  page = root / "page.html"
  explorer_page.write_page(str(analysis), str(page), str(masking))
  with np.load(analysis / "tiny-dlm" / "item_0.npz") as npz:
    arrays = {k: npz[k] for k in npz.files}
  traces = {}
  for name in ("sparse", "dkv"):
    with np.load(root / f"{name}_trace.npz") as npz:
      traces[name] = {k: npz[k] for k in npz.files}
  return {"analysis": analysis, "masking": masking, "page": page, "arrays": arrays, "dkv": dkv, "traces": traces}


def _chromium(*args: str) -> subprocess.CompletedProcess:
  profile = tempfile.mkdtemp(prefix="chromium-profile-")
  try:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                           "--force-device-scale-factor=1", f"--user-data-dir={profile}",
                           f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=3000", *args],
                          capture_output=True, text=True, timeout=120, check=False)
  finally:
    shutil.rmtree(profile, ignore_errors=True)


def _dom(page, fragment: str) -> str:
  done = _chromium("--dump-dom", f"file://{page}#{fragment}")
  assert "<body" in done.stdout, done.stderr[-2000:]
  return done.stdout


def _screenshot(page, fragment: str, path) -> np.ndarray:
  from PIL import Image  # pylint: disable=import-outside-toplevel
  _chromium(f"--screenshot={path}", f"file://{page}#{fragment}")
  return np.asarray(Image.open(path).convert("RGB"), np.int16)


def _expected_states(arrays, t: int) -> list[str]:
  """Each position's state after the t-th decoded step, from the trace: prompt / decoded / fresh / masked."""
  lp, step = int(arrays["prompt_length"]), int(arrays["step_index"][t])
  states = ["prompt"] * lp
  for d in arrays["decode_step"][:arrays["tokens"].shape[-1] - lp]:
    states.append("masked" if d > step else "fresh" if d == step else "decoded")
  return states


def _spans(dom: str) -> list[tuple[str, str]]:
  """(state, text) of the canvas panel's token spans."""
  canvas = dom[dom.index('id="canvas-tokens"'):dom.index("</div>", dom.index('id="canvas-tokens"'))]
  return [(m.group(1), m.group(2)) for m in re.finditer(r'data-state="(\w+)"[^>]*>([^<]*)</span>', canvas)]


def _unpack(entry: dict) -> np.ndarray:
  """A page's packed bool array {shape, bits} (`explorer_page._bits`) as a numpy array."""
  n = int(np.prod(entry["shape"]))
  bits = np.unpackbits(np.frombuffer(base64.b64decode(entry["bits"]), np.uint8), bitorder="little")
  return bits[:n].reshape(entry["shape"]).astype(bool)


def _strip_cells(dom: str) -> list[tuple[int, int]]:
  """(query computed, key read) of each key of the attention strip, in position order."""
  return [(int(m.group(1)), int(m.group(2))) for m in
          re.finditer(r'<div class="cell[^"]*" data-computed="(\d)" data-read="(\d)" data-pos="\d+"', dom)]


def test_page_holds_the_sparse_dllm_trace(run):
  """Sparse-dLLM: the page's computed positions, keys read and kept keys per layer are the Trace's."""
  model = explorer_page.page_data(str(run["analysis"]))["models"][0]
  trace, policy, steps = run["traces"]["sparse"], model["policy"], np.asarray(model["steps"])
  assert policy["text"] == SPARSE_POLICY
  computed = trace["computed"][steps, 0]  # [T, S]: item 0 is the batch's row 0
  n = computed.shape[-1]
  full = computed.all(-1)
  assert full.any() and (~full).any()  # full calls (a block's steps 0 and 1) and block-only calls
  assert np.array_equal(_unpack(policy["computed"]), computed)
  np.testing.assert_array_equal(policy["keys_read"], trace["keys_read"][steps, 0])
  keys = _unpack(policy["keys"])  # [T, L', 1, S]
  assert model["layers"] == list(range(trace["record"].shape[2]))
  assert keys.shape == (len(steps), len(model["layers"]), 1, n)
  record = trace["record"][steps, 0]  # [T, L, m]: each layer's kept keys, S = none
  for t in range(len(steps)):
    for layer in model["layers"]:
      expected = set(range(n)) if full[t] else ({int(p) for p in record[t, layer] if p < n}
                                                | set(np.flatnonzero(computed[t]).tolist()))
      assert set(np.flatnonzero(keys[t, layer, 0]).tolist()) == expected, (t, layer)
  # the library's own count: keys each computed query read, the mean over the layers
  np.testing.assert_allclose(keys[:, :, 0].sum(-1).mean(-1), trace["keys_read"][steps, 0])
  assert (keys[:, :, 0].sum(-1) < n).any()


def test_page_holds_the_dkv_cache_trace(run):
  """dKV-Cache: the page's computed positions are the Trace's; no key subset, no per-layer record; its notes say
  the rows each call ran (the Trace's record, below the budget at some call)."""
  model = explorer_page.page_data(str(run["dkv"]))["models"][0]
  trace, policy, steps = run["traces"]["dkv"], model["policy"], np.asarray(model["steps"])
  assert policy["text"] == "dkv_cache" and "keys" not in policy and "layers" not in policy
  computed = trace["computed"][steps, 0]
  assert (~computed.all(-1)).any()
  assert np.array_equal(_unpack(policy["computed"]), computed)
  np.testing.assert_array_equal(policy["keys_read"], trace["keys_read"][steps, 0])
  rows, full = trace["record_rows"][steps, 0], computed.all(-1)  # the rows each call ran: S full, else its bucket
  assert len(policy["notes"]) == len(steps)
  for note, is_full, ran in zip(policy["notes"], full, rows):
    assert note == "full call" if is_full else note.startswith(f"cached call, {ran} row"), (note, ran)
  assert (rows[~full] < 32).any(), rows  # a call below the budget: tiny-dlm's 32 generated positions


def test_a_run_without_policy_arrays_opens_unchanged(run, tmp_path):
  """A run written before the policy arrays (or without a policy): the same page data, no policy entry."""
  old = tmp_path / "old"
  shutil.copytree(run["analysis"], old)
  item = old / "tiny-dlm" / "item_0.npz"
  with np.load(item) as npz:
    arrays = {k: npz[k] for k in npz.files if not k.startswith("policy")}
  np.savez(item, **arrays)
  new, former = explorer_page.page_data(str(run["analysis"])), explorer_page.page_data(str(old))
  assert "policy" in new["models"][0] and "policy" not in former["models"][0]
  del new["models"][0]["policy"]
  assert former["models"] == new["models"] and former["panels"] == new["panels"]
  assert 'id="policy-meta"' in explorer_page.render(former)


def test_page_is_one_self_contained_file(run):
  for page in (run["page"], run["analysis"] / explorer_page.PAGE_FILE):
    text = page.read_text(encoding="utf-8")
    assert page.stat().st_size < 5e6
    assert not re.search(r"https?://|<link|<script[^>]+src=|<img|@import|fetch\(", text)
  data = explorer_page.page_data(str(run["analysis"]), str(run["masking"]))
  assert data["masking"]["models"]["tiny-dlm"]["item"] == "0"
  assert [r["k"] for r in data["masking"]["models"]["tiny-dlm"]["rows"]] == [0, 1]


def test_explore_binary_refuses_to_write_into_its_input(run, tmp_path):
  inside = fx.run_module("experiments.explore", str(run["analysis"]),
                         f"--html_out={run['analysis'] / 'x.html'}")
  assert inside.returncode == 1 and "an input" in inside.stderr and not (run["analysis"] / "x.html").exists()
  done = fx.run_module("experiments.explore", str(run["analysis"]), f"--masking_dir={run['masking']}",
                       f"--html_out={tmp_path / 'page.html'}")
  assert done.returncode == 0, done.stderr[-2000:]
  assert (tmp_path / "page.html").read_text(encoding="utf-8") == run["page"].read_text(encoding="utf-8")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium); CI has it")
def test_browser_plays_the_trace(run, tmp_path):
  arrays, page = run["arrays"], run["page"]
  vocab = dict(zip(arrays["vocab_ids"].tolist(), arrays["vocab_text"].tolist()))
  steps = len(arrays["step_index"])
  last = steps - 1
  early = _dom(page, "model=tiny-dlm&step=0&layer=1&head=2")
  late = _dom(page, f"model=tiny-dlm&step={last}&layer=1&head=2")
  policy = explorer_page.page_data(str(run["analysis"]))["models"][0]["policy"]
  computed, keys = _unpack(policy["computed"]), _unpack(policy["keys"])
  assert not computed[last].all()  # the last step computed its block only
  for dom, t in ((early, 0), (late, last)):
    assert 'data-ready="1"' in dom and f'data-steps="{steps}"' in dom and f'data-step="{t}"' in dom
    assert f"compute policy {SPARSE_POLICY}" in dom and f'data-computed="{computed[t].sum()}"' in dom
    assert _strip_cells(dom) == list(zip(computed[t].astype(int).tolist(), keys[t, 1, 0].astype(int).tolist()))
    assert re.search(r'<pre id="errors">\s*</pre>', dom), dom[dom.index('id="errors"'):][:500]
    spans = _spans(dom)
    assert [s for s, _ in spans] == _expected_states(arrays, t)
    for position, (state, text) in enumerate(spans):  # decoded and prompt tokens are the run's tokens
      if state != "masked":
        assert text.replace("&amp;", "&") == vocab[int(arrays["tokens"][position])], position
  assert "top-1" in late and "layer 1, head 2" in late  # the masking panel and the chosen layer and head
  assert "A later capture" in late and "0.625" in late  # a captures/*.json grid panel

  before, after = _screenshot(page, "step=0", tmp_path / "a.png"), _screenshot(page, f"step={last}", tmp_path / "b.png")
  rects_before = json.loads(re.search(r'<pre id="layout" hidden="">(.*?)</pre>', early).group(1))
  rects_after = json.loads(re.search(r'<pre id="layout" hidden="">(.*?)</pre>', late).group(1))
  states_before, states_after = _expected_states(arrays, 0), _expected_states(arrays, last)
  changed = unchanged = 0
  for position, (a, b) in enumerate(zip(states_before, states_after)):
    x, y, w, h = rects_before[position]
    if y + h > WINDOW[1]:
      continue
    region_a = before[y:y + h, x:x + w]
    if a == b == "prompt":  # the prompt never changes: same pixels at both steps
      assert rects_after[position] == rects_before[position]
      assert np.array_equal(region_a, after[y:y + h, x:x + w]), position
      unchanged += 1
    elif a != b:  # a position the trace decoded between the two steps: its pixels changed
      x2, y2, w2, h2 = rects_after[position]
      assert region_a.shape != after[y2:y2 + h2, x2:x2 + w2].shape or not np.array_equal(
          region_a, after[y2:y2 + h2, x2:x2 + w2]), position
      changed += 1
  assert changed > 0 and unchanged > 0
