"""Compute policies: per-step statistics that decide which keys, queries and layers a model call computes."""
