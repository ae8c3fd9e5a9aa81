"""`python -m sample`: text from a model that `python -m train` saved (see sample/cli.py)."""
