"""Per-task settings of the reference evaluation scripts, chosen with `preset=NAME` (values from
`reference/field_2026_12.md` §2.3 and `reference/peers.md` §5.1; sources per preset in `SOURCES`).

A preset maps lm-eval task names to model_args values; a request's task uses the entry whose name equals
its task name or is the longest prefix of it followed by "_" (so `mmlu` covers `mmlu_anatomy`), else the
preset's "*" entry. Values the user gives in model_args win over the preset's. The number of few-shot
examples is lm-eval's own `--num_fewshot`, listed in the guide, not here.

UNVERIFIED: whether the scripts' `batch_size` (8 for LLaDA's, 32 for dllm's) is the Monte-Carlo minibatch
(here `mc_batch`, the stratum of LLaDA's estimator) — LLaDA's harness uses its batch size that way, so
the presets set mc_batch to it, capped at mc_num; dllm's `begin_suppress_tokens` / `suppress_tokens` and
LLaDA's EOS rules of the instruct presets are not model_args here and are not applied.
"""

from __future__ import annotations

from typing import Any

_LLADA_LIKELIHOOD = {
    "gpqa_main_n_shot": dict(cfg=0.5), "truthfulqa_mc2": dict(cfg=2.0), "arc_challenge": dict(cfg=0.5),
    "hellaswag": dict(cfg=0.5), "winogrande": dict(cfg=0.0), "piqa": dict(cfg=0.0),
}
_LLADA_SINGLE_TOKEN = ("mmlu", "cmmlu", "ceval-valid")
_LLADA_GEN = ("bbh", "gsm8k", "minerva_math", "humaneval", "mbpp")


def _llada_base(mc_num: int, mc_batch: int, length: int) -> dict[str, dict[str, Any]]:
  tasks = {name: dict(values, mc_num=mc_num, mc_batch=mc_batch) for name, values in _LLADA_LIKELIHOOD.items()}
  tasks.update({name: dict(mc_num=1, mc_batch=1, cfg=0.0) for name in _LLADA_SINGLE_TOKEN})
  tasks.update({name: dict(gen_length=length, steps=length, block_length=length) for name in _LLADA_GEN})
  tasks["*"] = dict(mc_num=mc_num, mc_batch=mc_batch)
  return tasks


def _gen(length: int, block: int | None = None, **extra) -> dict[str, Any]:
  return dict(gen_length=length, steps=length, block_length=block or length, **extra)


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "llada_official": _llada_base(128, 8, 1024),
    "llada_official_512": _llada_base(128, 8, 512),
    "llada_official_256": _llada_base(128, 8, 256),
    "dllm": _llada_base(32, 32, 1024),
    "dllm_llada_instruct": {
        "gsm8k_cot": _gen(512), "minerva_math": _gen(512), "humaneval_instruct_llada": _gen(512),
        "mbpp_instruct_llada": _gen(256), "gpqa_diamond_generative_n_shot": _gen(64), "mmlu_generative": _gen(3),
        "mmlu_pro": _gen(256), "hellaswag_gen": _gen(3), "arc_challenge_chat": _gen(512),
        "*": dict(temperature=0.0, cfg=0.0)},
    "dllm_dream_base": {"mmlu": dict(mc_num=16, mc_batch=16), "gpqa_main_n_shot": dict(mc_num=32, mc_batch=32),
                        "*": dict(estimator="dream")},
    "dllm_dream_instruct": {
        "gsm8k_cot": dict(gen_length=256, steps=256), "minerva_math": dict(gen_length=512, steps=512),
        "humaneval_instruct_dream": dict(gen_length=768, steps=768),
        "mbpp_instruct_dream": dict(gen_length=1024, steps=1024), "ifeval": dict(gen_length=1280, steps=1280),
        "*": dict(temperature=0.1, top_p=0.9, alg="entropy")},
}
"""preset name -> task name -> model_args values."""

SOURCES = {
    "llada_official": "ML-GSAI/LLaDA eval_llada_lm_eval.sh (LLaDA-8B-Base): mc_num 128 (batch 8), cfg per task, "
                      "MMLU/CMMLU/C-Eval mc_num 1, generation tasks gen_length = steps = block_length = 1024",
    "llada_official_512": "as llada_official with generation tasks at 512 (LLaDA EVAL.md's second length)",
    "llada_official_256": "as llada_official with generation tasks at 256 (LLaDA EVAL.md's third length)",
    "dllm": "ZHZisZZ/dllm examples/llada/eval.sh (LLaDA-8B-Base): the same tasks and cfg, mc_num 32 (batch 32), "
            "MMLU mc_num 1; generation tasks at 1024",
    "dllm_llada_instruct": "ZHZisZZ/dllm examples/llada/eval.sh (LLaDA-8B-Instruct): generation lengths per task, "
                           "gen_length = steps = block_length",
    "dllm_dream_base": "ZHZisZZ/dllm examples/dream/eval.sh (Dream-v0-Base): MMLU mc_num 16, GPQA 32, others "
                       "the default (128); Dream's antithetic estimator",
    "dllm_dream_instruct": "ZHZisZZ/dllm examples/dream/eval.sh (Dream-v0-Instruct): T 0.1, top-p 0.9, alg "
                           "entropy, lengths per task (steps = length)",
}


def task_values(preset: str | None, task: str | None) -> dict[str, Any]:
  """The preset's values for `task` (module docstring); {} without a preset."""
  if preset is None:
    return {}
  table = PRESETS[preset]
  if task in table:
    return dict(table[task])
  matches = [name for name in table if name != "*" and task and task.startswith(name + "_")]
  if matches:
    return dict(table[max(matches, key=len)])
  return dict(table.get("*", {}))
