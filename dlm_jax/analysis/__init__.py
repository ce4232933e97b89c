"""Measures computed from what a run returned: attention-sink metrics (sinks.py), expert routing of sinks
(routing.py) and Monte-Carlo ELBO likelihoods for multiple-choice scoring (likelihood.py)."""
