"""Compute policies: statistics of one denoising step decide what the next step computes (issue 36)."""
