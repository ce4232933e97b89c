"""The decoding session (`dlm_jax.session`): the library never imports the binaries; the one resolver gives
the options a sampler would be given by hand, with the block rule and the fit check applied once; its errors
reach the binaries' one-line convention (with the --helpfull pointer for settings that do not go together)."""

import ast
import pathlib

import pytest

from dlm_jax.config import preset
from dlm_jax.sampling import autoregressive, block_diffusion, dream, llada, registry
from dlm_jax.session import (CombinationError, DecodeSettings, DecodingMode, SessionError, model_settings,
                             sampler_options)
from dlm_jax.session.checkpoint_bundle import Model
from experiments.common import checkpoints, cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_library_never_imports_the_binaries():
  offenders = []
  for path in sorted((ROOT / "dlm_jax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if n.split(".")[0] in ("experiments", "benchmarks", "converters")]
  assert not offenders, offenders


@pytest.fixture(scope="module")
def tiny_dlm():
  return checkpoints.prepare("tiny-dlm", "auto", "plain")  # no weights: settings are checked before any


def test_recorded_values_become_the_options_written_by_hand(tiny_dlm):
  values = model_settings(DecodeSettings(gen_length=8, steps=8, block_length=4), tiny_dlm)
  assert sampler_options.from_values(values, tiny_dlm.config, padded=True) == llada.LLaDAOptions(
      gen_length=8, steps=8, block_length=4, confidence_ranking="log_odds", padding="key", cfg_padding=True,
      shift_positions=True)
  official = dict(values, padding="official")
  assert sampler_options.from_values(official, tiny_dlm.config, padded=True) == llada.LLaDAOptions(
      gen_length=8, steps=8, block_length=4, confidence_ranking="log_odds", padding="key")
  assert sampler_options.from_values(values, tiny_dlm.config) == llada.LLaDAOptions(
      gen_length=8, steps=8, block_length=4, confidence_ranking="log_odds")
  common = registry.CommonSettings(gen_length=8, steps=8, block_length=4, alg="entropy")
  assert sampler_options.options("dream", common, DecodingMode(), {}, config=tiny_dlm.config) == dream.DreamOptions(
      gen_length=8, steps=8, alg="entropy")  # exact decoding has no blocks
  common = registry.CommonSettings(gen_length=8, top_k=3)
  assert sampler_options.options("ar", common, DecodingMode(), {}, config=tiny_dlm.config,
                                 end_ids=(7, 2)) == autoregressive.AROptions(
      gen_length=8, top_k=3, stop_at_eos=True, eos_token_ids=(2, 7))
  assert sampler_options.options("ar", common, DecodingMode(), {}, config=tiny_dlm.config, end_ids=(7, 2),
                                 stop_at_eos=False) == autoregressive.AROptions(gen_length=8, top_k=3)


def test_the_block_rules_and_the_fit_check(tiny_dlm):
  with pytest.raises(SessionError) as error:
    model_settings(DecodeSettings(gen_length=10, steps=8, block_length=4), tiny_dlm)
  assert str(error.value) == ("tiny-dlm: --block_length=4 must divide --gen_length=10 (gen_length must be a "
                              "multiple of block_length)")
  with pytest.raises(SessionError, match=r"^tiny-dlm: --steps=6 must be a multiple of the number of blocks "
                                         r"gen_length / block_length = 4$"):
    model_settings(DecodeSettings(gen_length=16, steps=6, block_length=4), tiny_dlm)
  with pytest.raises(CombinationError, match="classifier-free guidance"):
    model_settings(DecodeSettings(gen_length=8, steps=8, block_length=4, cfg_scale=1.0), tiny_dlm,
                   DecodingMode("dual_cache"))
  config = preset("tiny-llada2")
  block = config.attention_block_size
  common = registry.CommonSettings(gen_length=2 * block, steps=2)
  assert sampler_options.options("block_diffusion", common, DecodingMode(), {}, config=config) == (
      block_diffusion.BlockDiffusionOptions(gen_length=2 * block, steps=2, block_length=block))
  with pytest.raises(SessionError, match=rf"^--block_length={2 * block} must be the model's attention block "
                                         rf"\({block}\) for block_diffusion; leave it unset$"):
    sampler_options.options("block_diffusion", registry.CommonSettings(gen_length=2 * block, block_length=2 * block),
                            DecodingMode(), {}, config=config)


@pytest.mark.parametrize("error,pointer", [(SessionError("--decoding=fast: expected one of exact"), False),
                                           (CombinationError("--decoding=dual_cache keeps a KV cache"), True)])
def test_session_errors_are_the_binaries_one_line_errors(error, pointer, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.report(error)
  line = capsys.readouterr().err.strip()
  assert exit_info.value.code == 1 and "\n" not in line and line.endswith(str(error) + (" (see --helpfull)"
                                                                                          if pointer else ""))


def test_elastic_cache_decoding_is_a_mode_of_the_session(tiny_dlm):
  """--window / --eos_truncation (lm-eval window= / eos_truncation=) reach LLaDAOptions and DreamOptions (Dream
  without blocks), are recorded and read back, and are refused in one line outside threshold / factor without a
  cache or on a sampler without them."""
  from dlm_jax.session import decoding_mode
  from experiments.lm_eval import args
  mode = decoding_mode.from_values("threshold", threshold=0.9, window=16, eos_truncation=True)
  assert mode.record() == {"decoding": "threshold", "threshold": 0.9, "window": 16, "eos_truncation": True}
  assert DecodingMode.from_record(mode.record()) == mode
  assert DecodingMode.from_record({"decoding": "threshold", "threshold": 0.9}).window is None  # old records
  common = registry.CommonSettings(gen_length=32, steps=32, block_length=32)
  assert sampler_options.options("llada", common, mode, {}, config=tiny_dlm.config) == llada.LLaDAOptions(
      gen_length=32, steps=32, block_length=32, threshold=0.9, window=16, eos_truncation=True)
  factor = decoding_mode.from_values("factor", factor=1.0, eos_truncation=True)
  assert sampler_options.options("llada", common, factor, {}, config=tiny_dlm.config) == llada.LLaDAOptions(
      gen_length=32, steps=32, block_length=32, factor=1.0, eos_truncation=True)
  assert args.parse({"checkpoint": "tiny-dlm", "decoding": "threshold", "window": "16",
                     "eos_truncation": "true"}).mode == mode
  for kwargs, error, message in [
      (dict(decoding="exact", window=16), CombinationError, "--window (Elastic-Cache's decoding) runs with "
       "--decoding=threshold or a factor mode without a cache, not --decoding=exact"),
      (dict(decoding="threshold_dual_cache", eos_truncation=True), CombinationError, "--eos_truncation "
       "(Elastic-Cache's decoding) runs with --decoding=threshold or a factor mode without a cache, not "
       "--decoding=threshold_dual_cache"),
      (dict(decoding="threshold", window=0), SessionError, "--window=0: expected a positive integer"),
  ]:
    with pytest.raises(error) as info:
      decoding_mode.from_values(**kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
  with pytest.raises(CombinationError, match="the block_diffusion sampler has no eos_truncation / window decoding"):
    mode.option_fields("block_diffusion")
  dream_model = Model("tiny-dream", "", preset("tiny-dream"), None, None, {}, "dream", "plain")
  decode = dict(gen_length=32, steps=32, alg="maskgit_plus")  # p(x0), as Dream's threshold mode
  values = model_settings(DecodeSettings(**decode), dream_model, mode)  # Dream: no blocks
  assert mode.whole_generation("dream") and not mode.whole_generation("llada")
  assert sampler_options.from_values(values, dream_model.config) == dream.DreamOptions(
      gen_length=32, steps=32, alg="maskgit_plus", threshold=0.9, window=16, eos_truncation=True)
  with pytest.raises(SessionError, match="tiny-dream: .*no blocks") as info:
    model_settings(DecodeSettings(**decode, block_length=8), dream_model, mode)
  assert "\n" not in str(info.value)


def test_a_policy_with_guidance_is_refused_by_the_session():
  mode = DecodingMode(decoding="threshold", threshold=0.9, policy="dkv_cache")
  mode.check_guidance(0.0)
  with pytest.raises(CombinationError) as info:
    mode.check_guidance(1.5)
  assert str(info.value) == ("--policy=dkv_cache does not run with classifier-free guidance (--cfg_scale=1.5); use "
                             "--cfg_scale=0 or --policy=none")
