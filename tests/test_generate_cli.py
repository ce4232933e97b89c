"""experiments.generate end to end on tiny converted checkpoints: JSON and NPZ contents. The binary's cases run
in one process (`experiments_fixtures.run_modules`), except `--helpfull` and `--cpu_devices`, whose process
start is part of what they test."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from dlm_jax import model
from dlm_jax.io import checkpoint
from dlm_jax.instrument import interventions as iv
from dlm_jax.config import preset
from dlm_jax.sampling import autoregressive, dream, llada
from dlm_jax.policy.registry import parse_policy
from dlm_jax.instrument.stats import StatsSpec
from dlm_jax.model import CallInstruments, Compute
from dlm_jax.sampling.run_setup import RunSetup

try:
  from tests import experiments_fixtures as fx
except ImportError:
  import experiments_fixtures as fx

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "hello world what is two plus two the answer four user assistant".split()
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


def _tokenizer_dir(path):
  """A WordLevel tokenizer whose ids 0, 1, 2 are BOS, EOS, EoT (the tiny presets' ids)."""
  vocab = {token: i for i, token in enumerate(SPECIALS + WORDS + ["[UNK]"])}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.add_special_tokens(SPECIALS)
  os.makedirs(path, exist_ok=True)
  tokenizer.save(os.path.join(path, "tokenizer.json"))
  return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpt")
  tok = _tokenizer_dir(str(root / "tok"))
  dirs = {}
  for name, seed in (("tiny-llada", 11), ("tiny-dream", 11), ("tiny-llama", 11), ("tiny-llada2", 12)):
    config = preset(name)
    params = model.init_params(config, jax.random.key(seed))
    dirs[name] = (str(root / name), config, params)
    checkpoint.save(dirs[name][0], config, params, tokenizer_dir=tok if name == "tiny-llada" else None)
  return dirs


PROMPT_IDS = [5, 9, 7, 12, 8]
IDS = "--prompt_ids=" + ",".join(map(str, PROMPT_IDS))
POLICY = "dkv_cache:cache_reloading_step=2"
REFUSED_POLICIES = (
    (("--policy=dkv_cache", "--decoding=dual_cache"),
     "--policy=dkv_cache does not compose with --decoding=dual_cache"),
    (("--policy=dkv_cache:every=2",), "policy dkv_cache has no knob 'every'"),
    (("--policy=sparse_dllm:keep_sinks=50",),  # refused when the run binds it
     "sparse_dllm keep_sinks=50 is more than the 6 keys outside the block"))
MESH_RUN = ("--prompt_ids=5,9,7", "--gen_length=8", "--steps=4", "--block_length=4")
CASES = {  # name: (checkpoint, flags); every case but --helpfull and --cpu_devices runs in one process
    "llada_stats": ("tiny-llada", ("--sampler=llada", IDS, "--gen_length=8", "--steps=4", "--block_length=4",
                                   "--stats_out={out}.npz")),
    "chat": ("tiny-llada", ("--sampler=llada", "--prompt=what is two plus two", "--chat", "--gen_length=4",
                            "--steps=2", "--block_length=4")),
    "dream": ("tiny-dream", ("--sampler=dream", IDS, "--gen_length=6", "--steps=4", "--alg=entropy", "--top_p=0.95")),
    "ar_masked": ("tiny-llama", ("--sampler=ar", "--prompt_ids=5,9,7", "--gen_length=5", "--mask_sinks=1")),
    "ar_steps_ignored": ("tiny-llama", ("--sampler=ar", "--prompt_ids=5,9,7", "--gen_length=5", "--mask_sinks=1",
                                        "--steps=3")),
    "mmada_masked": ("tiny-llada", ("--sampler=mmada", "--prompt_ids=5,9,7", "--gen_length=8", "--steps=8",
                                    "--block_length=4", "--mask_sinks=2")),
    "policy": ("tiny-llada", ("--sampler=llada", IDS, "--gen_length=8", "--steps=8", "--block_length=4",
                              f"--policy={POLICY}")),
    **{f"policy_refused_{i}": ("tiny-llada", ("--sampler=llada", "--prompt_ids=5,6", "--gen_length=8",
                                              "--block_length=4", *flags))
       for i, (flags, _) in enumerate(REFUSED_POLICIES)},
    "gen_length_10": ("tiny-llada", ("--sampler=llada", "--prompt_ids=5,6", "--gen_length=10", "--block_length=4")),
    "no_prompt": ("tiny-llada", ("--sampler=llada",)),
    "llada_defaults": ("tiny-llada", ("--prompt_ids=5,9",)),
    "dream_defaults": ("tiny-dream", ("--prompt_ids=5,9", "--gen_length=4")),
    "mesh_alone": ("tiny-llada", MESH_RUN),
    "llada2_stats": ("tiny-llada2", ("--prompt_ids=5,6,7,8,9,10", "--gen_length=6", "--steps=4",
                                     "--stats_out={out}.npz")),
    "llada2_edited": ("tiny-llada2", ("--prompt_ids=5,6,7,8,9,10", "--gen_length=6", "--steps=4",
                                      "--editing_threshold=0.2", "--max_post_steps=2")),
    "llada2_llada": ("tiny-llada2", ("--prompt_ids=5,6", "--sampler=llada")),
    "llada2_dual_cache": ("tiny-llada2", ("--prompt_ids=5,6", "--decoding=dual_cache")),
}


def _flags(checkpoints, out, name, extra=()):
  directory, flags = CASES[name]
  return [f"--checkpoint={checkpoints[directory][0]}", f"--json_out={out}.json",
          *(f.format(out=out) for f in flags), *extra]


class Run:
  """One case's exit code, stderr, JSON result (None when it wrote none) and statistics path."""

  def __init__(self, code, stderr, out):
    self.returncode, self.stderr, self.stats = code or 0, stderr, f"{out}.npz"
    self.result = None
    if os.path.exists(f"{out}.json"):
      with open(f"{out}.json", encoding="utf-8") as f:
        self.result = json.load(f)

  def ok(self):
    assert self.returncode == 0, self.stderr[-3000:]
    return self.result


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
  """{case name: Run}: every case of CASES run by experiments.generate's main in one process
  (`experiments_fixtures.run_modules`)."""
  root = tmp_path_factory.mktemp("generate_cli")
  done = fx.run_modules([("experiments.generate", _flags(checkpoints, root / name, name)) for name in CASES])
  return {name: Run(code, stderr, root / name) for name, (code, stderr, _) in zip(CASES, done)}


def test_llada_json_and_attention_statistics(runs, checkpoints):
  directory, config, params = checkpoints["tiny-llada"]
  result = runs["llada_stats"].ok()
  stats_path = runs["llada_stats"].stats
  trace = llada.generate(params, np.asarray([PROMPT_IDS]), config=config,
                         options=llada.LLaDAOptions(gen_length=8, steps=4, block_length=4))
  assert result["tokens"] == np.asarray(trace.tokens)[0].tolist()
  assert result["decode_step"] == np.asarray(trace.decode_step)[0].tolist()
  assert result["prompt_length"] == 5 and result["nfe"] == 4 and "text" in result
  assert all(isinstance(t, int) for t in result["tokens"])
  incoming = np.load(stats_path)["incoming_attention"]
  assert incoming.dtype == np.float32 and incoming.shape == (4, config.n_layers, config.n_heads, 13)
  tokens, decode_step = np.asarray(result["tokens"]), np.asarray(result["decode_step"])
  for t in range(4):  # attention recomputed independently for the canvas of step t
    canvas = tokens.copy()
    canvas[5:] = np.where((decode_step >= 0) & (decode_step < t), tokens[5:], config.mask_token_id)
    dense = model.forward(params, jnp.asarray(canvas[None]), config=config, compute=Compute(attention_impl="dense"),
                          instruments=CallInstruments(stats_spec=StatsSpec(incoming_attention=True))).incoming_attention
    np.testing.assert_allclose(incoming[t], np.asarray(dense)[:, 0, 0], atol=2e-5)  # [L, B, Q, N, S]


def test_llada_chat_prompt_text(runs):
  result = runs["chat"].ok()
  assert result["tokens"][:2] == [0, 3]  # BOS, <|start_header_id|>
  assert result["prompt_length"] == len(result["tokens"]) - 4
  assert isinstance(result["text"], str)


def test_dream_matches_library(runs, checkpoints):
  directory, config, params = checkpoints["tiny-dream"]
  result = runs["dream"].ok()
  trace = dream.diffusion_generate(params, np.asarray([PROMPT_IDS]), config=config,
                                   options=dream.DreamOptions(gen_length=6, steps=4, alg="entropy", top_p=0.95))
  assert result["tokens"] == np.asarray(trace.tokens)[0].tolist()
  assert result["decode_step"] == np.asarray(trace.decode_step)[0].tolist()
  assert "text" not in result


def test_ar_and_mmada_with_sink_masking(runs, checkpoints):
  directory, config, params = checkpoints["tiny-llama"]
  result = runs["ar_masked"].ok()
  trace = autoregressive.generate(params, np.asarray([[5, 9, 7]]), config=config,
                                  options=autoregressive.AROptions(gen_length=5),
                                  setup=RunSetup(intervention=iv.MaskPreviousSinksAR(top_k=1)))
  assert result["tokens"] == np.asarray(trace.tokens)[0].tolist()
  assert result["decode_step"] == list(range(5)) and result["nfe"] == 5
  ignored = runs["ar_steps_ignored"]
  assert ignored.returncode == 0
  assert "--steps applies to --sampler=llada, mmada, dream, block_diffusion, diffusion_gemma only" in ignored.stderr
  directory, config, params = checkpoints["tiny-llada"]
  result = runs["mmada_masked"].ok()
  trace = llada.generate(params, np.asarray([[5, 9, 7]]), config=config,
                         options=llada.mmada_options(gen_length=8, steps=8, block_length=4),
                         setup=RunSetup(intervention=iv.MaskPreviousSinks(top_k=2)))
  assert result["tokens"] == np.asarray(trace.tokens)[0].tolist()
  assert result["decode_step"] == np.asarray(trace.decode_step)[0].tolist()


def test_a_compute_policy_from_the_flags_matches_the_library(runs, checkpoints):
  directory, config, params = checkpoints["tiny-llada"]
  result = runs["policy"].ok()
  trace = llada.generate(params, np.asarray([PROMPT_IDS]), config=config,
                         options=llada.LLaDAOptions(gen_length=8, steps=8, block_length=4),
                         setup=RunSetup(policy=parse_policy(POLICY)))
  assert result["tokens"] == np.asarray(trace.tokens)[0].tolist()
  assert result["decode_step"] == np.asarray(trace.decode_step)[0].tolist()
  for i, (_, message) in enumerate(REFUSED_POLICIES):
    refused = runs[f"policy_refused_{i}"]
    assert refused.returncode == 1 and message in refused.stderr and "Traceback" not in refused.stderr


def test_errors_are_reported(runs):
  result = runs["gen_length_10"]
  assert result.returncode != 0 and "multiple of block_length" in result.stderr
  result = runs["no_prompt"]
  assert result.returncode != 0 and "--prompt" in result.stderr


def test_defaults_are_the_official_ones(runs):
  """LLaDA: gen_length = steps = block_length = 128; Dream: steps 512, alg origin (its generation config)."""
  result = runs["llada_defaults"].ok()
  settings = result["settings"]
  assert result["sampler"] == "llada" and result["nfe"] == 128
  assert (settings["gen_length"], settings["steps"], settings["block_length"]) == (128, 128, 128)
  result = runs["dream_defaults"].ok()
  assert result["sampler"] == "dream" and result["nfe"] == 512 and result["settings"]["alg"] == "origin"
  assert result["settings"]["eps"] == 1e-3 and result["settings"]["temperature"] == 0.0


def test_helpfull_lists_only_the_flags_it_uses():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  text = subprocess.run([sys.executable, "-m", "experiments.generate", "--helpfull"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120).stdout
  for used in ("--checkpoint", "--mesh", "--dtype", "--attention_impl", "--[no]verbose", "--mask_sinks"):
    assert used in text, used
  for unused in ("--output_dir", "--max_items_this_run", "--samplers", "--n_items", "--task", "--overwrite"):
    assert unused not in text, unused


def test_mesh_may_use_a_subset_of_the_devices(runs, checkpoints, tmp_path):
  """The mesh run in a process of its own (--cpu_devices must come before the backend starts)."""
  alone = runs["mesh_alone"].ok()
  flags = _flags(checkpoints, tmp_path / "subset", "mesh_alone", ("--cpu_devices=4", "--mesh=tensor:2"))
  [(code, stderr, _)] = fx.run_modules([("experiments.generate", flags)])
  subset = Run(code, stderr, tmp_path / "subset").ok()
  assert subset["tokens"] == alone["tokens"]


def test_block_causal_moe_model_decodes_with_block_diffusion_and_reports_routing(runs, checkpoints):
  """auto picks block diffusion for a block-causal model (LLaDA2.x): tokens equal the library's, the npz has
  the router's choice; LLaDA's sampler and the cache modes are refused."""
  from dlm_jax.sampling import block_diffusion as bd  # pylint: disable=import-outside-toplevel
  directory, config, params = checkpoints["tiny-llada2"]
  result = runs["llada2_stats"].ok()
  assert result["sampler"] == "block_diffusion"
  options = bd.BlockDiffusionOptions(gen_length=6, block_length=4, steps=4)
  trace = bd.generate(params, jnp.asarray([[5, 6, 7, 8, 9, 10]]), config=config, options=options)
  assert result["tokens"] == np.asarray(trace.tokens)[0].tolist() and result["nfe"] == int(trace.nfe)
  with np.load(runs["llada2_stats"].stats) as npz:
    experts, nfe = npz["routed_experts"], result["nfe"]
    assert experts.shape == (nfe, 3, 12, 2) and (experts[:, 0] == -1).all() and (experts[:, 1:] >= 0).any()
  edited = runs["llada2_edited"].ok()
  options = bd.BlockDiffusionOptions(gen_length=6, block_length=4, steps=4, editing_threshold=0.2, max_post_steps=2)
  trace = bd.generate(params, jnp.asarray([[5, 6, 7, 8, 9, 10]]), config=config, options=options)
  assert edited["tokens"] == np.asarray(trace.tokens)[0].tolist() and edited["nfe"] == int(trace.nfe)
  assert edited["settings"]["editing_threshold"] == 0.2
  bad = runs["llada2_llada"]
  assert bad.returncode == 1 and "does not fit a block-causal model; use block_diffusion" in bad.stderr
  bad = runs["llada2_dual_cache"]
  assert bad.returncode == 1 and "always decodes with its exact KV cache" in bad.stderr
