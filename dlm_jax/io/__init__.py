"""Reading and writing: converted checkpoints and orbax training state (checkpoint.py), tokenizers and chat
templates (tokenizer.py); what keeps inputs and outputs safe: output directories that never touch their
sources (output_dir.py), JSON files decoded and type-checked (json_files.py), non-finite weights refused at
load (finite.py), and the checkpoint errors (errors.py)."""
