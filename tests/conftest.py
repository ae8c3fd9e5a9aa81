import jax
import pytest


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU; jax's default backend here is {jax.default_backend()!r}")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
