"""Trajectory rows of a masked-diffusion sampler run: one row per (item, step, position), for datasets.

A run with `trajectory_hooks` captures the chosen sites unreduced at the kept steps, plus the final-normed
hidden states (`ln_final.hook_normalized`), from which `step_readout` computes, inside one compiled
function, the model's own distribution at every kept step and position: its confidence (the largest
probability), its entropy (nats) and its argmax token, all float32 from the float32 logits before any
temperature or filter. They are in target coordinates: the value at position p is the distribution over
p's token (logit shift 1, Dream: the output of query p − 1; position 0 then reads nothing and holds NaN).

`batch_rows` turns a run into rows. A step is one model call (`Trace.nfe` numbering). Position classes at
step t (codes are indices into `dlm_jax.instrument.hook_spec.POSITION_CLASSES`), from `Trace.decode_step` d
of a generated position (the sampler decodes it at step d; −1: never):
  prompt (1)     a real (non-padding) prompt position;
  masked (2)     d < 0 or d >= t: the call at step t sees the mask token there;
  decoded (3)    d < t − 1: decoded before the previous call;
  committed (4)  d == t − 1: decoded by the previous call.
This is exact for samplers that never re-mask a decoded token (LLaDA / MMaDA / Dream low-confidence and
random remasking); `token` (the token the call sees) is the mask id at masked positions and the final token
elsewhere. A position counts at step t only when the call computed its query (`Trace.computed_queries`)
and decoded for its row (`Trace.active_rows`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.hook_spec import POSITION_CLASSES, Capture, Hooks, Steps
from dlm_jax.model.forward import lm_head

READOUT_SITE = "ln_final.hook_normalized"
CLASS_CODES = {name: POSITION_CLASSES.index(name) for name in ("prompt", "masked", "decoded", "committed")}
ROW_COLUMNS = {"item": ("int32", ()), "step": ("int32", ()), "progress": ("float32", ()),
               "position": ("int32", ()), "position_class": ("int8", ()), "token": ("int32", ()),
               "final_token": ("int32", ()), "predicted_token": ("int32", ()), "confidence": ("float32", ()),
               "entropy": ("float32", ()), "decode_step": ("int32", ()), "decoded_next": ("int8", ()),
               "correct": ("int8", ())}
"""The per-row columns every trajectory dataset has (name: (dtype, per-row shape)); `batch_rows` documents
them. The captured sites are columns too, named by site (float32, the feature shape per row)."""


def trajectory_hooks(sites: tuple[str, ...], steps: Steps) -> Hooks:
  """Captures of `sites` (full names, "blocks.1.hook_resid_post", or kinds for every layer) unreduced at
  every position at `steps`, and of the final-normed hidden states for `step_readout`."""
  captures = [Capture(site, steps=steps) for site in sites]
  if READOUT_SITE not in sites:
    captures.append(Capture(READOUT_SITE, steps=steps))
  return Hooks(captures=tuple(captures))


@functools.partial(jax.jit, static_argnames=("config",))
def step_readout(params, normalized: jax.Array, *, config: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """normalized [n, B, S, D] (the captured final-normed hidden states) -> confidence [n, B, S] float32,
  entropy [n, B, S] float32 (nats), argmax [n, B, S] int32, in target coordinates (module docstring); one
  step's logits [B, S, V] at a time."""

  def one(h):
    log_p = jax.nn.log_softmax(lm_head(params, h, config=config).astype(jnp.float32), axis=-1)
    p = jnp.exp(log_p)
    return jnp.max(p, -1), -jnp.sum(jnp.where(p > 0, p * log_p, 0.0), -1), jnp.argmax(log_p, -1).astype(jnp.int32)

  confidence, entropy, argmax = jax.lax.map(one, normalized)
  shift = config.logit_shift
  if shift:
    pad = lambda a, v: jnp.concatenate([jnp.full(a.shape[:-1] + (shift,), v, a.dtype), a[..., :-shift]], -1)
    confidence, entropy, argmax = pad(confidence, jnp.nan), pad(entropy, jnp.nan), pad(argmax, -1)
  return confidence, entropy, argmax


def position_classes(decode_step: np.ndarray, steps: np.ndarray, prompt_valid: np.ndarray) -> np.ndarray:
  """decode_step [B, G], steps [n] (step numbers), prompt_valid [B, Lp] bool -> [n, B, Lp + G] int8 class
  codes (module docstring; 0 at padding)."""
  d = decode_step[None].astype(np.int64)
  t = np.asarray(steps, np.int64)[:, None, None]
  generated = np.where((d < 0) | (d >= t), CLASS_CODES["masked"],
                       np.where(d == t - 1, CLASS_CODES["committed"], CLASS_CODES["decoded"]))
  prompt = np.where(prompt_valid, CLASS_CODES["prompt"], 0)[None].repeat(len(steps), 0)
  return np.concatenate([prompt, generated], axis=-1).astype(np.int8)


def batch_rows(*, tokens: np.ndarray, decode_step: np.ndarray, prompt_valid: np.ndarray, steps: np.ndarray,
               row_nfe: np.ndarray, active_rows: np.ndarray, computed_queries: np.ndarray, readout: tuple,
               activations: dict, classes: tuple[str, ...], mask_id: int, items: np.ndarray,
               correct: np.ndarray) -> dict[str, np.ndarray]:
  """The rows of one batch, item by item, then step by step, then position by position.

  tokens [B, S] final tokens; decode_step [B, G]; prompt_valid [B, Lp] (False at left padding); steps [n] the
  kept steps' numbers (−1: not run); row_nfe [B] the steps each row decoded with (`Trace.row_nfe`);
  active_rows [max_steps, B]; computed_queries [max_steps, 2]; readout: `step_readout`'s three [n, B, S]
  arrays; activations {site: [n, B, S, ...]}; classes: the position classes kept; items [b] the item index of
  the first b batch rows (the rest are padding rows); correct [b] int8 (1 / 0).

  Columns (`ROW_COLUMNS`): item; step; progress = step / (the row's steps − 1) (0 with one step); position
  (p − Lp: 0 is the first generated position, prompt positions are negative); position_class; token (the
  token the call saw); final_token; predicted_token, confidence, entropy (`step_readout`); decode_step (−1 at
  the prompt); decoded_next (1 when a masked position holds a token from the next step on, d == t); correct;
  and each site.
  """
  n_items = len(items)
  lp = prompt_valid.shape[1]
  kept = np.asarray(steps) >= 0
  run_steps = np.where(kept, steps, 0)
  klass = position_classes(decode_step, run_steps, prompt_valid)  # [n, B, S]
  s = tokens.shape[1]
  queries = computed_queries[run_steps]  # [n, 2]
  computed = (np.arange(s)[None] >= queries[:, :1]) & (np.arange(s)[None] < queries[:, 1:])  # [n, S]
  wanted = np.isin(klass, [CLASS_CODES[c] for c in classes])
  select = wanted & computed[:, None] & kept[:, None, None] & active_rows[run_steps][:, :, None]
  select[:, n_items:] = False
  row, slot, pos = np.nonzero(select.transpose(1, 0, 2))  # [B, n, S]: item-major order
  step = run_steps[slot].astype(np.int32)
  gen = pos - lp
  full_decode = np.concatenate([np.full((tokens.shape[0], lp), -1, np.int64), decode_step], axis=1)
  d = full_decode[row, pos]
  code = klass[slot, row, pos]
  final = tokens[row, pos]
  confidence, entropy, argmax = readout
  out = {"item": items[row].astype(np.int32), "step": step,
         "progress": (step / np.maximum(np.asarray(row_nfe)[row] - 1, 1)).astype(np.float32),
         "position": gen.astype(np.int32),
         "position_class": code.astype(np.int8),
         "token": np.where(code == CLASS_CODES["masked"], mask_id, final).astype(np.int32),
         "final_token": final.astype(np.int32), "predicted_token": argmax[slot, row, pos].astype(np.int32),
         "confidence": confidence[slot, row, pos].astype(np.float32),
         "entropy": entropy[slot, row, pos].astype(np.float32), "decode_step": d.astype(np.int32),
         "decoded_next": ((code == CLASS_CODES["masked"]) & (d == step)).astype(np.int8),
         "correct": correct[row].astype(np.int8)}
  for name, values in activations.items():
    out[name] = np.asarray(values[slot, row, pos], np.float32)
  return out
