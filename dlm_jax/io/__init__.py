"""Reading and writing: converted checkpoints and orbax training state (checkpoint.py), tokenizers and chat
templates (tokenizer.py)."""
