"""attnlayers: one attention layer for JAX/Flax with a choice of kernel.

  attnlayers.attention(q, k, v, backend="cudnn", is_causal=True)   # functional core
  attnlayers.explain("auto", q, k, v)                               # what would run, and why
  attnlayers.nnx.MultiHeadAttention / attnlayers.linen.MultiHeadDotProductAttention
"""

from attnlayers.backends import AUTO_ORDER, NAMES as BACKENDS
from attnlayers.core import attention, explain
from attnlayers.plan import BackendUnavailableError, Plan
from attnlayers.spec import ArgumentError

__all__ = ["attention", "explain", "BACKENDS", "AUTO_ORDER", "ArgumentError", "BackendUnavailableError", "Plan"]
__version__ = "0.1.0"
LAYER_MODULES = ("nnx", "linen", "fp8")  # imported on first use (attnlayers.linen...): each pulls in a Flax API


def __getattr__(name: str):
  if name in LAYER_MODULES:
    import importlib
    return importlib.import_module(f"attnlayers.{name}")
  raise AttributeError(f"module 'attnlayers' has no attribute {name!r}")
