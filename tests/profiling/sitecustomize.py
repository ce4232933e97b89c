"""Loaded at start-up by every Python subprocess of a profiled suite run (conftest puts this folder first on
PYTHONPATH only when `DLM_JAX_SUITE_PROFILE` is set): records the process's start, exit and JAX events."""

import os

if os.environ.get("DLM_JAX_SUITE_PROFILE"):
  import suite_events

  suite_events.start_subprocess_recording()
