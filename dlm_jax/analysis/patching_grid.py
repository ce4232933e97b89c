"""Activation-patching grids as rows of one compiled sampler program, and the logit-difference metric.

A grid patches a clean run's activations (captured at every step, `dlm_jax.analysis.patching.patch_values`)
into a corrupted run one cell at a time. Each cell is a row of the batch, decoding the corrupted prompt
with `Edit(site, "replace", source="values")`; the cell lives only in the row's traced edit values
(`dlm_jax.instrument.hook_call.edit_values`), so ONE compiled program serves every cell and every call:

  layer × step (a [D] site: hook_resid_pre, hook_attn_out, hook_mlp_out, …): row (pair p, layer l) of the
    call for step s has window [s, s + 1), the layer mask one-hot at l, every position, and values
    [1, Le, R, S, F...] holding pair p's clean values at step s (value_steps = [s]); a call covers every
    pair of the batch and every layer at one step.
  layer × head (a per-head site: attn.hook_z): row (pair p, layer l, head h) of the call for the step
    window [a, b) has that window, the layer mask one-hot at l and the head mask one-hot at h, and values
    [M, Le, R, S, N, H] holding pair p's clean values at the steps a..b−1 (value_steps a..b−1, then −1 for
    the slots of a shorter last window: M is fixed so every window shares the program).

Shapes: n steps of the clean run, Le the edit's layers, P pairs, R rows, S sequence positions, F features.
"""

from __future__ import annotations

import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.model import lm_head


def layer_step_rows(clean: np.ndarray, step: int) -> dict:
  """The edit values (keyword arguments of `edit_values`) of the layer × step call at `step`.

  clean: [n, Le, P, S, F...] the clean rows' patch values. Rows are (pair, layer) pairs in pair-major order:
  row r patches pair r // Le at layer r % Le. Returns window [R, 2], layers [R, Le] bool, positions None
  (every position), values [1, Le, R, S, F...], value_steps [1]."""
  n_layers, n_pairs = clean.shape[1], clean.shape[2]
  pair = np.repeat(np.arange(n_pairs), n_layers)
  layer = np.tile(np.arange(n_layers), n_pairs)
  rows = len(pair)
  return dict(window=np.tile(np.asarray([step, step + 1], np.int32), (rows, 1)),
              layers=np.eye(n_layers, dtype=bool)[layer],
              values=clean[step][:, pair][None], value_steps=np.asarray([step], np.int32))


def layer_head_rows(clean: np.ndarray, window: tuple[int, int], slots: int) -> dict:
  """The edit values of the layer × head call for the step window [start, stop).

  clean: [n, Le, P, S, N, H]. Rows are (pair, layer, head) in that order: row r patches pair
  r // (Le·N), layer (r // N) % Le, head r % N at every step of the window. slots: M >= stop − start,
  the fixed step-slot count (unused slots have value step −1). Returns window [R, 2], layers [R, Le],
  heads [R, N], values [M, Le, R, S, N, H], value_steps [M]."""
  n_layers, n_pairs, n_heads = clean.shape[1], clean.shape[2], clean.shape[4]
  start, stop = window
  if not 0 <= start < stop <= clean.shape[0] or stop - start > slots:
    raise ValueError(f"window {window} must lie in the run's {clean.shape[0]} steps and span at most {slots}.")
  pair = np.repeat(np.arange(n_pairs), n_layers * n_heads)
  layer = np.tile(np.repeat(np.arange(n_layers), n_heads), n_pairs)
  head = np.tile(np.arange(n_heads), n_pairs * n_layers)
  values = np.zeros((slots, n_layers, len(pair), *clean.shape[3:]), clean.dtype)
  values[:stop - start] = clean[start:stop][:, :, pair]
  steps = np.full((slots,), -1, np.int32)
  steps[:stop - start] = np.arange(start, stop)
  return dict(window=np.tile(np.asarray(window, np.int32), (len(pair), 1)), layers=np.eye(n_layers, dtype=bool)[layer],
              heads=np.eye(n_heads, dtype=bool)[head], values=values, value_steps=steps)


def logit_difference(params, hidden: np.ndarray, clean_token: np.ndarray, corrupted_token: np.ndarray, *,
                     config: ModelConfig) -> np.ndarray:
  """[R] float32: logit[clean_token] − logit[corrupted_token] of final-normed hidden states [R, D] through
  the LM head (`dlm_jax.model.lm_head`, the logits `forward` returns there)."""
  logits = np.asarray(lm_head(params, np.asarray(hidden)[:, None, :], config=config))[:, 0]
  rows = np.arange(logits.shape[0])
  return logits[rows, np.asarray(clean_token)] - logits[rows, np.asarray(corrupted_token)]


def answer_hidden(final_normed: np.ndarray, answer_position: np.ndarray, step: np.ndarray, shift: int) -> np.ndarray:
  """[R, D] the final-normed hidden state whose logits predict each row's answer position at `step`.

  final_normed: [n, R, S, D] (a `Steps.every_step()` capture of ln_final.hook_normalized) or [R, S, D] (a
  `Steps.decoded()` capture, step ignored); answer_position: [R] sequence index; step: [R] step index;
  shift: the model's logit shift (1: the logits of position p are read at p − 1)."""
  rows = np.arange(len(answer_position))
  position = np.asarray(answer_position) - shift
  if final_normed.ndim == 3:
    return final_normed[rows, position]
  return final_normed[np.asarray(step), rows, position]
