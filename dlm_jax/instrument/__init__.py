"""Looking inside a model call and acting on it: the statistics a forward computes (stats.py) and the
interventions that change its attention (interventions.py)."""
