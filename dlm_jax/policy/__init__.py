"""Compute policies: statistics of one denoising step decide which keys, queries and layers the next model
call computes (issue 36; DESIGN decision 13)."""
