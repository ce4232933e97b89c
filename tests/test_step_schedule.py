"""Step-scheduled steering (issue 33 item 4): a scheduled, gated edit in one forward against a NumPy forward with
the same edit written here, coefficient 0 as a bitwise no-op, the step table's alignment with the sampler's
steps, batch invariance of rows with different schedules in one program, and the one-line refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlm_jax.config import preset
from dlm_jax.instrument.hook_call import DECODED, MASKED, PROMPT, VALID, CaptureValues, HookCall, hook_values
from dlm_jax.instrument.hook_spec import Capture, Edit, Hooks
from dlm_jax.instrument.step_schedule import CoefficientSchedule, Gate, StepSchedule
from dlm_jax.model import CallInstruments, forward, init_params
from dlm_jax.sampling import LLaDAOptions, llada
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import numpy_transformer as ref
except ImportError:  # run from inside tests/
  import numpy_transformer as ref

jax.config.update("jax_default_matmul_precision", "highest")

CONFIG = preset("tiny-llada")
B, T, D = 2, 10, CONFIG.d_model
N_STEPS, N_BINS = 6, 3
TOL = dict(atol=2e-5, rtol=2e-5)
GATED = Hooks(captures=(Capture("hook_resid_post", layers=0, reduce="project", label="probe"),),
              edits=(Edit("hook_resid_post", "add", layers=1, positions="masked",
                          schedule=StepSchedule(N_STEPS, N_BINS, Gate("probe.0"))),))


@functools.lru_cache(maxsize=None)
def _params():
  return init_params(CONFIG, jax.random.key(3))


def _tokens():
  return np.asarray(jax.random.randint(jax.random.key(4), (B, T), 0, 200))


def _flags():
  flags = np.zeros((B, T), np.int32)
  flags[:, :4], flags[:, 4:7], flags[:, 7:] = VALID | PROMPT, VALID | MASKED, VALID | DECODED
  flags[1, 5] = VALID | DECODED
  return flags


def _gated_values(rng, coefficient):
  probe = rng.normal(size=(1, D)).astype(np.float32) * 0.3
  edit = dict(vector=rng.normal(size=(B, N_BINS, D)).astype(np.float32),
              coefficient=np.asarray(coefficient, np.float32),
              schedule=dict(table=rng.normal(size=(B, N_STEPS)).astype(np.float32),
                            bins=rng.integers(0, N_BINS, size=(B, N_STEPS)),
                            gate_scale=np.array([1.0, -2.0], np.float32), gate_bias=np.array([0.5, 0.1], np.float32)))
  return probe, edit


@jax.jit
def _gated_forward(params, tokens, values, flags, step):
  return forward(params, tokens, config=CONFIG,
                 instruments=CallInstruments(hooks=HookCall(hooks=GATED, values=values, flags=flags, step=step)))


@jax.jit
def _plain_logits(params, tokens):
  return forward(params, tokens, config=CONFIG).logits


def _run_gated(probe, edit, step):
  values = hook_values(GATED, CONFIG, B, T, captures={0: CaptureValues(directions=probe)}, edits={0: edit})
  return _gated_forward(_params(), jnp.asarray(_tokens()), values, jnp.asarray(_flags()), jnp.int32(step))


def test_gated_schedule_equals_the_numpy_forward_with_the_same_edit():
  rng = np.random.default_rng(0)
  probe, edit = _gated_values(rng, [1.5, -0.7])
  step = 4
  masked = (_flags() & MASKED) != 0
  schedule = edit["schedule"]
  readings = {}

  def reference_edit(name, value):
    if name == "blocks.0.hook_resid_post":
      readings["r"] = value @ probe[0].astype(np.float64)  # [B, T]
    if name == "blocks.1.hook_resid_post":
      rows = np.arange(B)
      coefficient = edit["coefficient"] * schedule["table"][rows, step]  # [B]
      vector = edit["vector"][rows, schedule["bins"][rows, step]]  # [B, D]
      gate = 1.0 / (1.0 + np.exp(-(schedule["gate_scale"][:, None] * readings["r"] + schedule["gate_bias"][:, None])))
      return value + (coefficient[:, None] * gate * masked)[..., None] * vector[:, None, :]
    return value

  logits, expected = ref.forward_sites(_params(), _tokens(), CONFIG, edit=reference_edit)
  out = _run_gated(probe, edit, step)
  np.testing.assert_allclose(np.asarray(out.logits), logits, **TOL)
  np.testing.assert_allclose(np.asarray(out.captures["probe.0"])[..., 0], readings["r"], **TOL)
  plain = forward(_params(), jnp.asarray(_tokens()), config=CONFIG)
  assert not np.allclose(np.asarray(out.logits), np.asarray(plain.logits), atol=1e-3)


def test_coefficient_zero_and_steps_past_the_table_are_bitwise_no_ops():
  rng = np.random.default_rng(1)
  probe, edit = _gated_values(rng, [0.0, 0.0])
  plain = np.asarray(_plain_logits(_params(), jnp.asarray(_tokens())))
  assert np.array_equal(np.asarray(_run_gated(probe, edit, 2).logits), plain)
  edit["coefficient"] = np.array([3.0, 3.0], np.float32)
  assert np.array_equal(np.asarray(_run_gated(probe, edit, N_STEPS).logits), plain)  # the table has steps 0..5
  assert not np.allclose(np.asarray(_run_gated(probe, edit, N_STEPS - 1).logits), plain, atol=1e-3)


def test_coefficient_schedules_as_tables():
  assert np.array_equal(CoefficientSchedule("constant", 2.0).table(3), [2.0, 2.0, 2.0])
  assert np.array_equal(CoefficientSchedule("window", 2.0, start=1, stop=3).table(4), [0.0, 2.0, 2.0, 0.0])
  assert np.array_equal(CoefficientSchedule("table", values=(1.0, -1.0)).table(3), [1.0, -1.0, 0.0])
  with pytest.raises(ValueError, match=r"^the window schedule names step 4, but the sampler runs at most 4 steps"):
    CoefficientSchedule("window", 1.0, start=2, stop=5).table(4)


OPTIONS = LLaDAOptions(gen_length=8, steps=4, block_length=8)
LP = 4
SAMPLER_HOOKS = Hooks(captures=(Capture("ln_final.hook_normalized", reduce="mean", positions="masked"),
                                Capture("hook_resid_post", layers=0, reduce="norm", label="gate")),
                      edits=(Edit("hook_resid_post", "add", layers=1, positions="masked",
                                  schedule=StepSchedule(4, 2, Gate("gate.0"))),))


def _sample(prompt, edit, batch_invariant=True, hooks=SAMPLER_HOOKS, options=OPTIONS):
  b = prompt.shape[0]
  values = hook_values(hooks, CONFIG, b, LP + options.gen_length, edits={0: edit})
  return llada.generate(_params(), jnp.asarray(prompt), config=CONFIG, options=options,
                        setup=RunSetup(hooks=hooks, hook_values=values, batch_invariant=batch_invariant))


def _prompt(b):
  return np.asarray(jax.random.randint(jax.random.key(7), (b, LP), 0, 200), np.int32)


def _sampler_edit(rng, b, coefficient, table):
  return dict(vector=rng.normal(size=(b, 2, D)).astype(np.float32) * 3, coefficient=np.asarray(coefficient, np.float32),
              schedule=dict(table=np.asarray(table, np.float32), bins=np.array([0, 0, 1, 1]),
                            gate_scale=np.linspace(-0.5, 0.5, b).astype(np.float32), gate_bias=np.ones(b, np.float32)))


def test_in_the_sampler_the_gated_table_acts_at_its_steps_and_rows_are_batch_invariant():
  rng = np.random.default_rng(2)
  prompt = _prompt(3)
  tables = [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]
  edit = _sampler_edit(rng, 3, [4.0, 2.0, 5.0], tables)
  batched = _sample(prompt, edit)
  means = np.asarray(batched.captures["ln_final.hook_normalized"])  # [steps, B, D]
  plain_edit = dict(edit, coefficient=np.zeros(3, np.float32))
  plain = _sample(prompt, plain_edit)
  plain_means = np.asarray(plain.captures["ln_final.hook_normalized"])
  # row 0: steered from step 2 only, so steps 0 and 1 are bitwise the plain run's; row 2's table is all zeros
  assert np.array_equal(means[:2, 0], plain_means[:2, 0]) and not np.allclose(means[2, 0], plain_means[2, 0])
  assert not np.allclose(means[0, 1], plain_means[0, 1])
  assert np.array_equal(means[:, 2], plain_means[:, 2])
  assert np.array_equal(np.asarray(batched.tokens)[2], np.asarray(plain.tokens)[2])
  for row in range(3):
    alone = _sample(prompt[row:row + 1], {**{k: v[row:row + 1] for k, v in edit.items() if k != "schedule"},
                                          "schedule": {k: v if k == "bins" else v[row:row + 1]
                                                       for k, v in edit["schedule"].items()}})
    assert np.array_equal(np.asarray(alone.tokens)[0], np.asarray(batched.tokens)[row])
    assert np.array_equal(np.asarray(alone.captures["ln_final.hook_normalized"])[:, 0], means[:, row])


def test_refusals_are_one_line_before_model_work():
  long = Hooks(edits=(Edit("hook_resid_post", "add", layers=0, schedule=StepSchedule(5)),))
  with pytest.raises(ValueError, match=r"^Edit 0 \(hook_resid_post\): its step schedule has 5 steps \(0\.\.4\), but "
                                       r"the sampler runs at most 4 steps \(0\.\.3\)\.$"):
    _sample(_prompt(1), dict(vector=np.zeros((1, D), np.float32)), hooks=long)
  late = Hooks(captures=(Capture("hook_resid_post", layers=1, reduce="norm", label="g"),),
               edits=(Edit("hook_resid_post", "add", layers=1, schedule=StepSchedule(4, gate=Gate("g.1"))),))
  with pytest.raises(ValueError, match="must be at a layer before every layer of the edit"):
    late.check(CONFIG)
  missing = Hooks(edits=(Edit("hook_resid_post", "add", layers=1, schedule=StepSchedule(4, gate=Gate("nope"))),))
  with pytest.raises(ValueError, match="its gate reads capture 'nope', which no capture produces"):
    missing.check(CONFIG)
  with pytest.raises(ValueError, match="on an 'add' edit with source 'vector'"):
    Edit("hook_resid_post", "scale", schedule=StepSchedule(4))
  with pytest.raises(ValueError, match=r"schedule bins must lie in \[0, 2\)"):
    hook_values(SAMPLER_HOOKS, CONFIG, 1, 12, edits={0: dict(vector=np.zeros((2, D)),
                                                             schedule=dict(bins=[0, 2, 0, 0]))})
  with pytest.raises(ValueError, match=r"a gate reads one \(directions \[1, F_last\]\)"):
    hook_values(GATED, CONFIG, B, T, captures={0: CaptureValues(directions=np.zeros((2, D)))},
                edits={0: dict(vector=np.zeros((N_BINS, D)))})
