"""Activation patching across sampler runs: a clean run's captures as patch values, and the result object.

The experiment (`experiments.activation_patching`): capture a site of a clean run at every step and layer
(`Capture(site, steps=Steps.every_step())`), turn the captures into patch values (`patch_values`), then
decode the corrupted input with `Edit(site, "replace", source="values")` and a per-row step window and
layer mask (`dlm_jax.instrument.hook_call.edit_values`): one compiled program serves every (layer, step)
of the grid, batched over rows. `PatchingResult` summarises the effects like TransformerLens's.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from dlm_jax.sampling.trace import Trace


def patch_values(trace: Trace, names: list[str]) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Patch values from a run's captures of one site: names are its captured arrays in the edit's layer
  order (e.g. "blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", …), each [M, B, S, F...] over the same
  kept steps. Returns (values [M, Le, B, S, F...], value_steps [M] int32: the step of each slot, −1 for a
  slot the run never filled, which matches no step)."""
  return captured_patch_values(trace.captures, trace.capture_steps, names)


def captured_patch_values(captures: dict | None, capture_steps: dict | None,
                          names: list[str]) -> tuple[jnp.ndarray, jnp.ndarray]:
  """`patch_values` of a run's `Trace.captures` and `Trace.capture_steps` alone (e.g. brought to the host
  without the rest of the `Trace`)."""
  missing = [n for n in names if captures is None or n not in captures]
  if missing:
    raise ValueError(f"the run captured no {missing[0]!r}; capture it with Capture(..., reduce='none').")
  steps = [np.asarray(capture_steps[n]) for n in names]
  if any(not np.array_equal(s, steps[0]) for s in steps[1:]):
    raise ValueError(f"the captures {names} were kept at different steps; capture them with one Capture.")
  return jnp.stack([captures[n] for n in names], axis=1), jnp.asarray(steps[0], jnp.int32)


@dataclasses.dataclass(frozen=True)
class PatchingResult:
  """Per-example effects of a set of patches, and their summary (as TransformerLens's `PatchingResult`).

  effects: [P, E] the metric of each of P patch conditions (a grid cell, flattened) on each of E examples;
  normalized: [P, E] (effect − corrupted) / (clean − corrupted) per example, NaN where clean = corrupted;
  clean, corrupted: [E] the unpatched metrics.
  """

  effects: np.ndarray
  clean: np.ndarray
  corrupted: np.ndarray

  @property
  def normalized(self) -> np.ndarray:
    gap = self.clean - self.corrupted
    with np.errstate(divide="ignore", invalid="ignore"):
      return np.where(gap != 0, (self.effects - self.corrupted) / np.where(gap != 0, gap, 1.0), np.nan)

  @staticmethod
  def _summary(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean over examples and its standard error (sample standard deviation / √n; NaN examples left out)."""
    n = np.sum(~np.isnan(x), axis=-1)
    mean = np.nanmean(x, axis=-1)
    std = np.sqrt(np.nansum((x - mean[..., None]) ** 2, axis=-1) / np.maximum(n - 1, 1))
    return mean, np.where(n > 1, std / np.sqrt(np.maximum(n, 1)), np.nan)

  def mean(self, normalized: bool = True) -> np.ndarray:
    """[P] mean effect over examples (normalized by default)."""
    return self._summary(self.normalized if normalized else self.effects)[0]

  def stderr(self, normalized: bool = True) -> np.ndarray:
    """[P] standard error of that mean."""
    return self._summary(self.normalized if normalized else self.effects)[1]

  def to_json(self) -> dict:
    """Plain lists for a JSON file (NaN as None)."""
    clean = lambda a: [None if isinstance(v, float) and math.isnan(v) else v for v in np.asarray(a).tolist()]  # noqa: E731
    return {"effects": [clean(row) for row in self.effects], "clean": clean(self.clean),
            "corrupted": clean(self.corrupted), "mean_normalized": clean(self.mean()),
            "stderr_normalized": clean(self.stderr())}
