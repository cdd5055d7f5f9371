"""Training drafters: regenerated data (data.py, regenerate.py), the loop every method shares
(trainer.py), one strategy per method (methods/), typed configs (config.py)."""
