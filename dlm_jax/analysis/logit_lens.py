"""The logit lens at every denoising step, over any sampler: when and where does a model compute the token
it finally decodes?

At the selected steps (model calls, numbered as `Trace.nfe` counts them) every layer's residual stream —
the token embeddings (`hook_embed`, row "embed") and each block's output (`blocks.{l}.hook_resid_post`,
rows "0".."L−1") — goes through the final norm and the LM head inside the compiled program
(`Capture(..., reduce="lens")`), and is read at the token finally decoded at its position: its probability,
its rank (0 = the most probable token) and the k most probable tokens. The last row is the model's own
prediction at that step (the distribution its sampler reads, before any temperature or filter).

Which (step, position) pairs count ("selected"): a generated position p whose token was still undecided
at that model call, read where the model predicts it, in a row the call decoded for (`Trace.active_rows`):
  logit shift 0 (LLaDA, MMaDA, LLaDA2, DiffusionGemma): the lens at p itself, for the positions in the
    sampler's "masked" class at that call (`dlm_jax.instrument.hook_spec`: holding the mask token;
    DiffusionGemma: not holding a token the previous step accepted);
  logit shift 1 (Dream, autoregressive models): the output at p − 1 predicts p, so the lens is read at
    query p − 1 for the positions p not yet decoded at that call (`Trace.decode_step[p] >= step`) whose
    query p − 1 the call computed. For an autoregressive model this is exactly one position per step: step
    i feeds the token at Lp + i − 1 (step 0: the prompt) and produces generated token i, so its lens is
    that fed position's prediction of the token generated there.
`LogitLens.only(counted)` narrows the generated positions further (e.g. to the answer and its first EOS).

Two passes: the final tokens are known only after the run, and the lens reads them as traced targets
(`CaptureValues(targets=[B, S])`), so the sampler runs once without hooks, then again with the same key and
settings, the lens captures and the final tokens as targets. The samplers are deterministic for a given key
and captures do not change what they decode; a lens pass that decodes other tokens raises.

The last row is the last block's output through the final norm and the LM head: the model's own
prediction (what `ln_final.hook_normalized` read with the lens gives too).

All arrays are in target coordinates: index p of the S = Lp + G sequence positions is the position whose
final token is read (for shift 1 the lens value computed at query p − 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from dlm_jax.config import ModelConfig
from dlm_jax.instrument.hook_call import CaptureValues, hook_values
from dlm_jax.instrument.hook_spec import NO_HOOKS, Capture, Hooks, Steps
from dlm_jax.sampling.trace import Trace

LENS_STEP_KINDS = ("all", "at", "every")


def row_names(config: ModelConfig) -> tuple[str, ...]:
  """The R = L + 1 lens rows: "embed", then "0".."L−1" (the last is the model's own prediction)."""
  return ("embed",) + tuple(str(l) for l in range(config.n_layers))


def lens_hooks(config: ModelConfig, steps: Steps, k: int) -> Hooks:
  """The captures of the lens (module docstring): hook_embed and every layer's hook_resid_post, reduced to
  the lens with k top tokens at `steps` ("masked" queries for logit shift 0, every query for shift 1)."""
  if steps.kind not in LENS_STEP_KINDS:
    raise ValueError(f"the logit lens keeps steps of kind {', '.join(LENS_STEP_KINDS)} (Steps.every_step(), "
                     f"Steps.at_steps(...), Steps.every(k)), got {steps.kind!r}.")
  positions = "masked" if config.logit_shift == 0 else "all"
  return Hooks(captures=(Capture("hook_embed", steps=steps, positions=positions, reduce="lens", k=k),
                         Capture("hook_resid_post", steps=steps, positions=positions, reduce="lens", k=k)))


def lens_targets(tokens: np.ndarray, shift: int) -> np.ndarray:
  """tokens [B, S] -> targets [B, S] int32 in query coordinates: the token each query's output predicts,
  tokens[:, q + shift] (the last `shift` queries read token 0 and are never selected)."""
  tokens = np.asarray(tokens, np.int32)
  if shift == 0:
    return tokens
  return np.concatenate([tokens[:, shift:], np.zeros((tokens.shape[0], shift), np.int32)], axis=1)


@dataclasses.dataclass(frozen=True)
class LogitLens:
  """The lens of one run (module docstring). n kept steps that ran, R rows (`rows`), B batch rows, S
  sequence positions, k top tokens; arrays are numpy, zero where not `selected`.

  steps: [n] int32 step numbers; rows: the R row names; tokens: [B, S] the final tokens; prompt_length: Lp.
  selected: [n, B, S] bool, the (step, position) pairs read.
  probability: [n, R, B, S] float32, p(final token); rank: [n, R, B, S] int32 (0 = top-1);
  top_tokens: [n, R, B, S, k] int32; top_probabilities: [n, R, B, S, k] float32.
  """

  steps: np.ndarray
  rows: tuple[str, ...]
  tokens: np.ndarray
  prompt_length: int
  selected: np.ndarray
  probability: np.ndarray
  rank: np.ndarray
  top_tokens: np.ndarray
  top_probabilities: np.ndarray

  @property
  def count(self) -> np.ndarray:
    """[n, B] int: the positions read at each step."""
    return self.selected.sum(-1)

  def _mean(self, values: np.ndarray) -> np.ndarray:
    weights = self.selected[:, None].astype(np.float64)
    total = (values * weights).sum(-1)
    count = weights.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
      return np.where(count > 0, total / count, np.nan)

  def mean_probability(self) -> np.ndarray:
    """[n, R, B] float64: mean p(final token) over the positions read (NaN where none)."""
    return self._mean(self.probability)

  def mean_rank(self) -> np.ndarray:
    """[n, R, B] float64: mean rank of the final token (0 = top-1) over the positions read (NaN where none)."""
    return self._mean(self.rank)

  def top1_fraction(self) -> np.ndarray:
    """[n, R, B] float64: the fraction of the positions read where the final token is the top-1 token."""
    return self._mean(self.rank == 0)

  def only(self, counted: np.ndarray) -> LogitLens:
    """This lens read only at the generated positions counted [B, G] bool (e.g. the answer and the token that
    ends it); the arrays are zeroed where no longer selected."""
    b, s = self.tokens.shape
    counted = np.asarray(counted, bool)
    if counted.shape != (b, s - self.prompt_length):
      raise ValueError(f"counted must be [B, G] = {[b, s - self.prompt_length]} bool, got {list(counted.shape)}.")
    selected = self.selected & np.concatenate([np.zeros((b, self.prompt_length), bool), counted], axis=1)[None]
    return _narrowed(self, selected)

  def first_top1_row(self) -> np.ndarray:
    """[n, B, S] int: the first row at which the final token is top-1 (an index into `rows`), −1 where no
    row has it top-1 or the position is not read."""
    top1 = self.rank == 0
    first = np.where(top1.any(1), np.argmax(top1, axis=1), -1)
    return np.where(self.selected, first, -1)


def _to_targets(values: np.ndarray, shift: int) -> np.ndarray:
  """[..., S] values in query coordinates -> target coordinates (value of query p − shift at p; 0 below)."""
  if shift == 0:
    return values
  pad = np.zeros(values.shape[:-1] + (shift,), values.dtype)
  return np.concatenate([pad, values[..., :-shift]], axis=-1)


def _narrowed(lens: LogitLens, selected: np.ndarray) -> LogitLens:
  """`lens` with `selected` [n, B, S] and its arrays zeroed elsewhere."""
  keep = selected[:, None]
  return dataclasses.replace(
      lens, selected=selected, probability=np.where(keep, lens.probability, 0).astype(np.float32),
      rank=np.where(keep, lens.rank, 0).astype(np.int32),
      top_tokens=np.where(keep[..., None], lens.top_tokens, 0).astype(np.int32),
      top_probabilities=np.where(keep[..., None], lens.top_probabilities, 0).astype(np.float32))


def from_trace(trace: Trace, config: ModelConfig) -> LogitLens:
  """The `LogitLens` of a run made with `lens_hooks` and `lens_targets` of its own tokens."""
  shift, lp = config.logit_shift, trace.prompt_length
  names = ["hook_embed"] + [f"blocks.{l}.hook_resid_post" for l in range(config.n_layers)]
  steps = np.asarray(trace.capture_steps[names[0]])
  ran = np.flatnonzero(steps >= 0)
  steps = steps[ran]
  readouts = [trace.captures[name] for name in names]

  def stack(field: str) -> np.ndarray:  # [n, R, B, S(, k)] in target coordinates
    values = np.stack([np.asarray(getattr(r, field))[ran] for r in readouts], axis=1)
    return np.moveaxis(_to_targets(np.moveaxis(values, 3, -1), shift), -1, 3)

  tokens = np.asarray(trace.tokens)
  b, s = tokens.shape
  top_probabilities = stack("top_probabilities")
  selected = top_probabilities[:, 0, :, :, 0] > 0  # a computed query of the capture's class (p ≥ 1/V > 0)
  generated = np.arange(s) >= lp
  selected &= generated[None, None, :]
  if shift:
    decode_step = np.concatenate([np.full((b, lp), -1), np.asarray(trace.decode_step)], axis=1)
    selected &= decode_step[None] >= steps[:, None, None]
  if trace.active_rows is not None:
    selected &= np.asarray(trace.active_rows)[steps][:, :, None]
  lens = LogitLens(steps=steps.astype(np.int32), rows=row_names(config), tokens=tokens, prompt_length=lp,
                   selected=selected, probability=stack("probability"), rank=stack("rank"),
                   top_tokens=stack("top_tokens"), top_probabilities=top_probabilities)
  return _narrowed(lens, selected)


def logit_lens(sample: Callable[..., Trace], config: ModelConfig, *, steps: Steps = Steps.every_step(),
               k: int = 5) -> LogitLens:
  """The logit lens of one sampler run (module docstring).

  sample: runs the sampler on the batch with everything bound but its hooks: sample(hooks=Hooks,
    hook_values=HookValues) -> Trace, deterministic for its key (e.g. a `functools.partial` of
    `dlm_jax.sampling.llada.generate` with params, prompt, config, options and key).
  config: the model's config; steps: the kept steps (`Steps.every_step()`, `Steps.at_steps(...)`,
    `Steps.every(k)`); k: top tokens kept.
  Raises ValueError for another kind of steps, RuntimeError when the lens pass decodes other tokens than the
  plain pass.
  """
  hooks = lens_hooks(config, steps, k)

  def run(tokens: np.ndarray) -> Trace:
    targets = jnp.asarray(lens_targets(tokens, config.logit_shift))
    values = hook_values(hooks, config, *tokens.shape,
                         captures={0: CaptureValues(targets=targets), 1: CaptureValues(targets=targets)})
    return sample(hooks=hooks, hook_values=values)

  first = np.asarray(sample(hooks=NO_HOOKS, hook_values=None).tokens)
  second = run(first)
  if not np.array_equal(np.asarray(second.tokens), first):
    raise RuntimeError("the sampler decoded other tokens when run again with the same key and settings; the logit "
                       "lens needs a deterministic sampler (the same tokens for the same key).")
  return from_trace(second, config)

