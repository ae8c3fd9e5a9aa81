import jax
import pytest

if jax.default_backend() == "gpu":
  # The float32 tolerances in tests/reference.py assume IEEE float32 matmuls; XLA on NVIDIA
  # GPUs runs float32 dots as TF32 by default (errors ~1e-3), which would test the matmul
  # unit rather than the attention code. bfloat16 paths are unaffected.
  jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU; jax's default backend here is {jax.default_backend()!r}")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
