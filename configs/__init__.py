"""ml_collections configs: `python -m experiments.train --config=configs/NAME.py[:smoke]`."""
