"""The decoding explorer: one self-contained HTML page that plays a run's generations in a browser.

  python -m experiments.explore RUN_DIR [--masking_dir=DIR] [--html_out=FILE.html]
  python -m experiments.sink_analysis --html          # the same page, written into its output directory

RUN_DIR is a finished `experiments.sink_analysis` run (its summary.json and each model's
item_<figure_item>.npz) or a `sink_masking_eval` run (then the page shows the masking panel only);
--masking_dir adds a sink_masking_eval run's completions of the same item under each condition. The page
(default results/explore/<RUN_DIR name>.html; never inside RUN_DIR, which is an input) holds its data, script
and style inline: no network, no CDN, it works from file://. For each model it shows the sequence after every
decoded step (masked / decoded / committed at that step), a step slider and a play button, the incoming
attention of a chosen layer and head over the keys at that step (sinks by the run's ε-rule marked, the tokens
as labels) and over all steps, the decode order, and the sink-masking conditions side by side; for a run decoded
under a compute policy (--policy) what each step computed: the policy in the header, the positions whose queries
the step computed (a row under the attention strip), the keys each layer (and head) read (dropped keys hatched),
and for per-layer policies the positions each layer recomputed (a layer × position strip). The URL
fragment chooses what is shown: #model=tiny-dlm&step=3&layer=1&head=2 (head=mean for the head mean).

Data format (`page_data`, JSON inside the page): {"version": 1, "title", "palette": {meaning: colour},
"models": [model], "masking": {"models": {label: {"item", "rows": [{"k", "text", "correct", "nfe"}]}}} or
null, "panels": [panel]}. A model: label, sampler, item, prompt, completion, correct, layers, n_heads,
prompt_length, tokens [S] (final token text), decode_step [S] (−1 in the prompt), steps [T] (the sampler step
of each decoded step shown, the steps that ran), canvas [T][S] (token ids each step read), vocab {id: text},
attention {"shape": [T, L', N + 1, S] (head N = the head mean), "max": [L' × (N + 1)], "q": base64 of
uint8 levels, score = (level / 255)² × max}, sinks [T][L'][N + 1] (sink positions; head mean: a sink in any
head), and under a compute policy "policy": {"text" (the policy as it ran, `parse_policy` text), "computed": bits
[T, S] (the positions whose queries each step computed), "keys_read" [T] (keys per computed query, mean over
layers), "notes" [T] (a line per step), "keys": bits [T, L', H', S] (key-subset policies: the keys each recorded
layer read; H' = 1, the same for every head, or N + 1 with head N "any head"), "layers": bits [T, L, S]
(per-layer policies: per model layer the positions recomputed)}, where bits = {"shape", "bits": base64 of the
packed bools, C order, least significant bit first}; the item's policy_* arrays give it
(`experiments.reports.policy_view`, one translation of `Trace.computed_positions` / `keys_read` /
`policy_record` per policy kind); a run without them has no "policy". A panel (for later captures: logit lens,
patching grids): {"title", "kind": "grid", "rows", "cols",
"values" [rows][cols], "note"}; every RUN_DIR/captures/*.json holding such a panel (or a list of them) is
added. Other panel kinds are added to reports/explorer_assets/explorer.js; the page is built by
`experiments.reports.explorer_page`.
"""

from __future__ import annotations

import os

from absl import flags

from experiments.reports import explorer_page
from experiments.common import cli, flag_checks

_MASKING_DIR = flags.DEFINE_string("masking_dir", None, "A sink_masking_eval run directory: the same item under "
                                   "each masking condition.")
_HTML_OUT = flags.DEFINE_string("html_out", None, "Output HTML file (default results/explore/<RUN_DIR name>.html).")


def default_output(run: str) -> str:
  return os.path.join("results", "explore", os.path.basename(os.path.normpath(run)) + ".html")


def main(argv):
  if len(argv) != 2:
    raise cli.UsageError("give one RUN_DIR: python -m experiments.explore RUN_DIR [--masking_dir=DIR]")
  run = argv[1]
  flag_checks.not_blank(html_out=_HTML_OUT.value)
  path = os.path.abspath(_HTML_OUT.value or default_output(run))
  if os.path.commonpath([path, os.path.abspath(run)]) == os.path.abspath(run):
    raise cli.UserError(f"--html_out={path} is inside RUN_DIR {run}, an input; write it elsewhere")
  size = explorer_page.write_page(run, path, _MASKING_DIR.value)
  print(f"{path} ({size / 1e6:.2f} MB): open it in a browser")


if __name__ == "__main__":
  cli.run(main, arguments=1)
