"""Speed and memory measurements."""
