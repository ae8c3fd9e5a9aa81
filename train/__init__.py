"""Training loop for models.GPT: `python -m train --help`."""
