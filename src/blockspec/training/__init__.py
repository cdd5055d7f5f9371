"""Training drafters: regenerated data (data.py), the DFlash recipe (trainer.py), typed configs (config.py)."""
