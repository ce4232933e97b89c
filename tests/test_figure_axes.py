"""The logic of the figures, without rendering: integer ticks, the steps that ran, token labels, the moving-sink
rule, the layers shown, the palette; and the axes the plots set (figures built, never drawn)."""

import numpy as np

from experiments.reports import figure_axes, palette
from experiments.reports import plots, sink_report


def test_integer_ticks_are_whole_cells_and_few():
  assert figure_axes.integer_ticks(3).tolist() == [0, 1, 2]  # the uniform model's 3 steps: no −0.5 … 1.5
  assert figure_axes.integer_ticks(28, 8).tolist() == [0, 5, 10, 15, 20, 25]
  assert figure_axes.integer_ticks(68, 7).tolist() == [0, 10, 20, 30, 40, 50, 60]
  assert figure_axes.integer_ticks(128, 10).tolist() == list(range(0, 128, 20))
  assert figure_axes.integer_ticks(0).size == 0


def test_steps_that_ran_drops_the_steps_after_the_end():
  valid = np.zeros((27, 10), bool)  # tiny-arm's Fig. 1: generation ended at step 14 of 27
  valid[:15, :5] = True
  valid[3, :] = False  # a step in the middle that read nothing still counts (it is before the end)
  assert figure_axes.steps_that_ran(valid) == 15
  assert figure_axes.steps_that_ran(np.zeros((4, 3), bool)) == 0


def test_token_labels():
  tokens = ["[PAD]", "Ġthe", "Ċ", "a b", "x" * 20]
  assert figure_axes.position_labels([1, 2, 3], tokens) == ["1 ␣the", "2 ⏎", "3 a␣b"]
  assert figure_axes.token_text(tokens[4]) == "x" * 11 + "…" and figure_axes.token_text(None) == "?"
  scores = np.zeros((3, 6))
  scores[:, 4] = [5, 5, 5]
  scores[:, 1] = [1, 9, 9]
  scores[0, 2] = 0.5
  assert figure_axes.top_positions(scores, 2).tolist() == [1, 4]
  assert figure_axes.top_positions(scores, 9).tolist() == [1, 2, 4]  # zero-score keys are never named
  tracks = [np.asarray([9, 9, 9, 2, -1]), np.asarray([2, 5, 5, 7, 7])]  # 9 ×3, 2 ×2, 5 ×2, 7 ×2
  assert figure_axes.most_visited(tracks, 3) == [2, 5, 9] and figure_axes.most_visited([np.asarray([-1])]) == []


def test_moving_sink_rule():
  largest = np.full((6, 2, 3), 7)  # [steps, layers, heads]; every head static at 7
  largest[:, 1, 2] = [3, 3, 5, 5, 8, 8]  # two moves, three positions
  largest[:, 0, 1] = [3, -1, 4, -1, 3, 3]  # −1 (no sink) skipped: 3 → 4 → 3: two moves, two positions
  largest[:, 1, 0] = [1, 2, 1, 1, 1, 1]  # two moves, two positions, but a later layer than (0, 1)
  assert figure_axes.head_movement(largest[:, 0, 1]) == (2, 2)
  assert figure_axes.moving_heads(largest, 3) == [(1, 2, 2), (0, 1, 2), (1, 0, 2)]
  quiet = np.full((6, 2, 3), 7)
  busy = quiet.copy()
  busy[:, 0, 0] = [1, 2, 3, 4, 5, 6]
  assert figure_axes.most_moving_item({"0": quiet, "1": busy, "2": busy.copy()}) == "1"  # ties: the earlier item
  assert figure_axes.most_moving_item({}) is None


def test_shown_layers_are_all_of_a_small_model():
  assert figure_axes.shown_layers([0, 1, 2, 3]) == [0, 1, 2, 3]  # Fig. 1 no longer leaves layer 1 out
  picks = figure_axes.shown_layers(list(range(32)))
  assert len(picks) == 6 and picks[0] == 0 and picks[-1] == 31


def test_one_colour_per_meaning():
  meanings = [palette.SINK, palette.NORMAL, palette.PROMPT_END, palette.BLOCK_START, palette.MASKED, palette.DECODED,
              palette.JUST_COMMITTED]
  assert len(set(meanings)) == len(meanings)
  first = palette.model_colours(["tiny-arm", "mine", "tiny-dlm"])
  second = palette.model_colours(["tiny-dlm", "other", "tiny-arm"])
  assert first["tiny-arm"] == second["tiny-arm"] == palette.MODELS["tiny-arm"]  # same model, same colour
  assert first["mine"] not in set(meanings) | set(palette.MODELS.values())
  assert len(set(palette.model_colours([f"m{i}" for i in range(5)]).values())) == 5


def test_plots_set_integer_ticks_and_token_labels():
  scores = np.zeros((3, 8), np.float32)
  scores[:, 5] = 4.0
  tokens = [f"t{i}" for i in range(8)]
  fig = plots.step_heatmaps([("layer 0", scores)], "x", prompt_length=4, tokens=tokens, named=1)
  ax = fig.axes[0]
  assert ax.get_yticks().tolist() == [0, 1, 2]
  assert all(float(t).is_integer() for t in ax.get_xticks())
  top = [a for a in ax.child_axes if a.get_xticks().size]  # the secondary axis marking the top key
  assert top[0].get_xticks().tolist() == [5] and ax.get_title().endswith("top keys: 5 t5")
  fig = plots.largest_sink_tracks({"layer 0 head 1": np.asarray([5, 5, 2])}, "x", tokens=tokens)
  assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["2 t2", "5 t5"]
  assert fig.axes[0].get_legend().get_bbox_to_anchor().x0 > fig.axes[0].bbox.x1 - 1  # beside the axes
  fig = plots.score_histogram(np.linspace(0, 10, 11), {"tiny-dlm": np.arange(10)}, 3.0, "x")
  labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  assert any("overflow bin" in l and "≥ 9" in l for l in labels)
  assert fig.axes[0].get_lines()[0].get_color() == palette.MODELS["tiny-dlm"]


def test_token_strings_of_an_item_file():
  data = {"vocab_ids": np.asarray([0, 3, 7]), "vocab_text": np.asarray(["[PAD]", "[MASK]", "four"])}
  assert sink_report.token_strings(data, np.asarray([7, 3, -1, 0])) == ["four", "[MASK]", "·", "[PAD]"]
  assert sink_report.token_strings({}, np.asarray([1])) is None
