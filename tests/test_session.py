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
