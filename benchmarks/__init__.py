"""Benchmarks: `python -m benchmarks.train` (end to end)."""
