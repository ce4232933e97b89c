"""The sampler runs of experiments.activation_patching for one model: the clean / corrupted capture run,
the layer × step and layer × head grid calls, and attribution patching, per chunk of pairs.

Shapes: P pairs of a chunk, n steps of a run, Le layers, R rows of a call, S sequence positions, D d_model.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.analysis import attribution, patching_grid
from dlm_jax.analysis.patching import captured_patch_values
from dlm_jax.instrument import sites
from dlm_jax.instrument.hook_call import hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks, Steps
from dlm_jax.model import abstract_params
from dlm_jax.runtime import distributed
from experiments.common import decoding, patching_pairs, progress
from experiments.common.patching_pairs import PromptPair

FINAL = "ln_final.hook_normalized"
EVERY_STEP = "ln_final_steps"
"""Label of the every-step capture of the final-normed hidden states."""


class PatchRunner:
  """Runs one model's pairs (settings: the binary's `Settings`; values: its decoding values)."""

  def __init__(self, settings, model, values: dict[str, Any], pair_set: patching_pairs.PairSet, runtime):
    self.settings, self.model, self.values, self.pair_set, self.runtime = settings, model, values, pair_set, runtime
    config = model.config
    self.n_steps = values["steps"] if model.diffusion else values["gen_length"]
    self.steps = tuple(settings.patch_steps or range(self.n_steps))
    self.shift = config.logit_shift
    self.prompt_set = patching_pairs.prompt_set(model, pair_set.pairs)
    self.grid_sites = [s for s in settings.sites if s not in ("attn.hook_z",)]
    self.head_sites = [s for s in settings.sites if s == "attn.hook_z"]
    self.attribution = (settings.attribution and model.diffusion and not self.prompt_set.masked
                        and values.get("decoding", "exact") == "exact" and bool(self.grid_sites))
    window = settings.head_window or self.n_steps
    self.head_windows = [(a, min(a + window, self.n_steps)) for a in range(0, self.n_steps, window)]
    self.window_slots = window
    metric = [Capture(FINAL, steps=Steps.decoded())] if self.shift == 0 else []
    every = [Capture(FINAL, steps=Steps.every_step(), label=EVERY_STEP)]
    self.head_captures = tuple(metric + (every if self.shift else []))
    self.grid_captures = tuple(metric + (every if self.shift or self.attribution else []))
    self.capture_hooks = Hooks(captures=self.grid_captures + tuple(Capture(s) for s in settings.sites))

  @property
  def chunk(self) -> list[PromptPair]:
    return self.pair_set.pairs[:self.settings.pairs_per_call]

  def meta(self) -> dict:
    """What the report needs about this model's run."""
    config = self.model.config
    return {"label": self.model.label, "sampler": self.model.sampler, "directory": progress.display_path(
                self.model.directory), "settings": self.values, "n_layers": config.n_layers, "n_heads": config.n_heads,
            "n_steps": self.n_steps, "patch_steps": list(self.steps), "grid_sites": self.grid_sites,
            "head_sites": self.head_sites, "head_windows": [list(w) for w in self.head_windows],
            "attribution": self.attribution, "skipped": self.pair_set.skipped}

  def _layers(self) -> int:
    return self.model.config.n_layers

  def _sampler(self, hooks, edit, prompts, key, params=None):
    values = None if edit is None else hook_values(hooks, self.model.config, prompts.ids.shape[0],
                                                   prompts.ids.shape[1] + self.values["gen_length"], edits={0: edit})
    sample = decoding.sampler(self.model, self.values, prompts, self.runtime, self.settings.numerics, key=key,
                              params=params)
    return lambda: sample(hooks=hooks, hook_values=values)

  def capture_plans(self):
    """[(name, thunk)] the capture plans of the largest calls, for `capture_budget.check` (abstract weights:
    nothing is loaded or computed)."""
    pairs, n_layers, config = self.chunk, self._layers(), self.model.config
    s_total = self.prompt_set.width + self.values["gen_length"]
    abstract = abstract_params(config, jnp.float32)

    def plan(hooks, prompts, key, edit_shapes):
      def thunk():
        params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
        edit = None if edit_shapes is None else {k: jnp.zeros(v, jnp.float32) if k == "values" else v
                                                 for k, v in edit_shapes.items()}
        return self._sampler(hooks, edit, prompts, key, params)()
      return thunk

    plans = [("capture run", plan(self.capture_hooks, patching_pairs.batch(self.prompt_set, pairs),
                                  patching_pairs.keys(0, pairs, 1, True), None))]
    for site in self.grid_sites:
      shape = (1, n_layers, len(pairs) * n_layers, s_total, *sites.feature_shape(config, site, 0))
      plans.append((f"{site} grid call", plan(self._grid_hooks(site), patching_pairs.batch(
          self.prompt_set, pairs, True, n_layers), patching_pairs.keys(0, pairs, n_layers),
          dict(values=shape, value_steps=np.zeros(1, np.int32)))))
    for site in self.head_sites:
      heads = sites.feature_shape(config, site, 0)[0]
      shape = (self.window_slots, n_layers, n_layers * heads, s_total, *sites.feature_shape(config, site, 0))
      plans.append((f"{site} head call", plan(self._head_hooks(site), patching_pairs.batch(
          self.prompt_set, pairs[:1], True, n_layers * heads), patching_pairs.keys(0, pairs[:1], n_layers * heads),
          dict(values=shape, value_steps=np.zeros(self.window_slots, np.int32)))))
    return plans

  def _grid_hooks(self, site):
    return Hooks(captures=self.grid_captures, edits=(Edit(site, "replace", source="values"),))

  def _head_hooks(self, site):
    return Hooks(captures=self.head_captures, edits=(Edit(site, "replace", source="values"),))

  def _run(self, hooks, prompts, key, edit=None) -> dict:
    trace = decoding.generate(self.model, self.values, prompts, self.runtime, self.settings.numerics, key=key,
                              hooks=hooks, hook_values=None if edit is None else hook_values(
                                  hooks, self.model.config, prompts.ids.shape[0],
                                  prompts.ids.shape[1] + self.values["gen_length"], edits={0: edit}))
    return distributed.to_host({"tokens": trace.tokens, "decode_step": trace.decode_step,
                                "captures": trace.captures, "capture_steps": trace.capture_steps})

  def _answer(self, pairs, repeat: int):
    """[R] answer positions (sequence), answer indices, clean and corrupted tokens of rows that repeat each pair."""
    index = np.repeat([p.answer_index for p in pairs], repeat)
    return (self.prompt_set.width + index, index, np.repeat([p.clean_token for p in pairs], repeat),
            np.repeat([p.corrupted_token for p in pairs], repeat))

  def _metric(self, host, pairs, repeat: int, immediate_step: int | None = None):
    """[R] the metric at the answer's decode step in each row's run, and (immediate_step) at that step."""
    position, index, clean, corrupted = self._answer(pairs, repeat)
    rows = np.arange(len(position))
    decoded_at = np.maximum(host["decode_step"][rows, index], 0)
    metric = functools.partial(patching_grid.logit_difference, self.model.params, clean_token=clean,
                               corrupted_token=corrupted, config=self.model.config)
    final = host["captures"][FINAL] if self.shift == 0 else host["captures"][EVERY_STEP]
    at_decode = metric(patching_grid.answer_hidden(final, position, decoded_at, self.shift))
    if immediate_step is None:
      return at_decode, decoded_at, None
    every = host["captures"][EVERY_STEP]
    steps = np.full(len(rows), immediate_step)
    return at_decode, decoded_at, metric(patching_grid.answer_hidden(every, position, steps, self.shift))

  def run(self, log) -> None:
    """Patches every pair not in `log` yet, a chunk of --pairs_per_call at a time, appending one record each."""
    label = self.model.label
    todo = [p for p in self.pair_set.pairs if not log.done(model=label, item=p.id)]
    meter = progress.Progress(f"{label} pairs", len(self.pair_set.pairs), len(self.pair_set.pairs) - len(todo))
    size = self.settings.pairs_per_call
    for start in range(0, len(todo), size):
      for record in self._chunk(todo[start:start + size]):
        meter.update(int(log.append(record)))

  def _chunk(self, pairs: list[PromptPair]) -> list[dict]:
    n_pairs, n_layers, seed = len(pairs), self._layers(), self.settings.decode.seed
    host = self._run(self.capture_hooks, patching_pairs.batch(self.prompt_set, pairs),
                     patching_pairs.keys(seed, pairs, 1, True))
    clean_rows, corrupted_rows = slice(0, n_pairs), slice(n_pairs, 2 * n_pairs)
    both, decode_both, _ = self._metric(host, pairs + pairs, 1)
    values = {site: _patch_values(host, site, n_layers) for site in self.settings.sites}
    records = [self._record(p, i, host, both, decode_both) for i, p in enumerate(pairs)]
    corrupted_steps = None
    if self.attribution:
      position, _, clean, corrupted = self._answer(pairs, 1)
      every = host["captures"][EVERY_STEP][:, corrupted_rows]
      corrupted_steps = np.stack([patching_grid.logit_difference(
          self.model.params, patching_grid.answer_hidden(every, position, np.full(n_pairs, s), self.shift), clean,
          corrupted, config=self.model.config) for s in range(self.n_steps)])  # [n, P]
      for i, record in enumerate(records):
        record["corrupted_step_metric"] = corrupted_steps[:, i]
    for site in self.grid_sites:
      grid = np.zeros((n_pairs, n_layers, len(self.steps)))
      immediate = np.zeros_like(grid)
      prompts = patching_pairs.batch(self.prompt_set, pairs, True, n_layers)
      for j, step in enumerate(self.steps):
        edit = patching_grid.layer_step_rows(values[site][:, :, clean_rows], step)
        out = self._run(self._grid_hooks(site), prompts, patching_pairs.keys(seed, pairs, n_layers), edit)
        at_decode, _, now = self._metric(out, pairs, n_layers, step if self.attribution else None)
        grid[:, :, j] = at_decode.reshape(n_pairs, n_layers)
        if now is not None:
          immediate[:, :, j] = now.reshape(n_pairs, n_layers)
      for i, record in enumerate(records):
        record["grids"][site] = grid[i]
        if self.attribution:
          record["immediate"][site] = immediate[i] - corrupted_steps[list(self.steps), i][None, :]
      if self.attribution:
        self._attribute(site, pairs, host, values[site], records, corrupted_steps)
    for site in self.head_sites:
      for i, pair in enumerate(pairs):
        record = records[i]
        heads = sites.feature_shape(self.model.config, site, 0)[0]
        prompts = patching_pairs.batch(self.prompt_set, [pair], True, n_layers * heads)
        per_window = []
        for window in self.head_windows:
          edit = patching_grid.layer_head_rows(values[site][:, :, [i]], window, self.window_slots)
          out = self._run(self._head_hooks(site), prompts, patching_pairs.keys(seed, [pair], n_layers * heads),
                          edit)
          per_window.append(self._metric(out, [pair], n_layers * heads)[0].reshape(n_layers, heads))
        record["heads"][site] = np.stack(per_window)
    return records

  def _record(self, pair: PromptPair, i: int, host, both, decode_both) -> dict:
    n_pairs = len(both) // 2
    tok = self.model.tokenizer
    generated = host["tokens"][:, self.prompt_set.width:]
    p = pair.pair
    return {"model": self.model.label, "item": pair.id, "role": p.role, "operand": p.operand, "old": p.old,
            "new": p.new, "clean_question": p.clean.question, "corrupted_question": p.corrupted.question,
            "answer_index": pair.answer_index, "clean_token": tok.id_to_token(pair.clean_token),
            "corrupted_token": tok.id_to_token(pair.corrupted_token),
            "clean_correct": bool(generated[i, pair.answer_index] == pair.clean_token),
            "corrupted_correct": bool(generated[n_pairs + i, pair.answer_index] == pair.corrupted_token),
            "clean_metric": float(both[i]), "corrupted_metric": float(both[n_pairs + i]),
            "answer_decode_step": [int(decode_both[i]), int(decode_both[n_pairs + i])],
            "patch_steps": list(self.steps), "grids": {}, "heads": {}, "immediate": {}, "attribution": {},
            "head_windows": [list(w) for w in self.head_windows]}

  def _attribute(self, site, pairs, host, values, records, corrupted_steps) -> None:
    """Attribution patching of `site` at the grid's steps (module `dlm_jax.analysis.attribution`)."""
    n_pairs = len(pairs)
    position, _, clean, corrupted = self._answer(pairs, 1)
    config = self.model.config
    sequences = attribution.sequences_before_steps(host["tokens"][n_pairs:], host["decode_step"][n_pairs:],
                                                 self.prompt_set.width, config.mask_token_id, np.asarray(self.steps))
    grads = _gradient_fn(config, site, self.settings.numerics.attention_impl, self.settings.numerics.query_chunk)
    result = np.zeros((n_pairs, values.shape[1], len(self.steps)))
    gap = 0.0
    for j, step in enumerate(self.steps):
      metric, gradient = grads(self.model.params, jnp.asarray(sequences[j]), jnp.asarray(position - self.shift),
                               jnp.asarray(clean), jnp.asarray(corrupted))
      gap = max(gap, float(np.max(np.abs(np.asarray(metric) - corrupted_steps[step]))))
      result[:, :, j] = attribution.attribution(np.asarray(gradient), values[step][:, :n_pairs],
                                                values[step][:, n_pairs:]).T
    for i, record in enumerate(records):
      record["attribution"][site] = result[i]
      record["attribution_metric_gap"] = max(record.get("attribution_metric_gap", 0.0), gap)


@functools.lru_cache(maxsize=None)
def _gradient_fn(config, site: str, attention_impl: str, query_chunk: int):
  """jit of (params, sequence [P, S], position [P], clean [P], corrupted [P]) -> (metric [P], gradient
  [Le, P, S, *F])."""
  def fn(params, sequence, position, clean, corrupted):
    return attribution.site_gradients(params, sequence, attribution.logit_difference_at(position, clean, corrupted),
                                      config=config, site=site, attention_impl=attention_impl, query_chunk=query_chunk)
  return jax.jit(fn)


def _patch_values(host: dict, site: str, n_layers: int) -> np.ndarray:
  """[n, Le, B, S, *F] a capture run's values of `site` at every step (slot i holds step i)."""
  values, steps = captured_patch_values(host["captures"], host["capture_steps"],
                                       [sites.full_name(site, l) for l in range(n_layers)])
  if not np.array_equal(np.asarray(steps), np.arange(len(steps))):
    raise RuntimeError(f"the capture run kept {site} at steps {np.asarray(steps).tolist()}, not at every step")
  return np.asarray(values)
