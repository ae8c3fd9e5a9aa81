"""Requirements several backends share, each returning the unmet ones as readable reasons."""

from __future__ import annotations

import numpy as np

from attnlayers.spec import Call

HALF = (np.dtype("float16"), np.dtype("bfloat16"))


def nvidia_gpu(call: Call, min_cc: tuple[int, int], what: str) -> list[str]:
  dev = call.device
  if not dev.is_cuda:
    return [f"{what} needs an NVIDIA GPU with compute capability >= {min_cc[0]}.{min_cc[1]}; "
            f"jax's default device is {dev.describe()} (use backend='xla' or 'naive' here)"]
  if dev.compute_capability < min_cc:
    cc = dev.compute_capability
    return [f"{what} needs compute capability >= {min_cc[0]}.{min_cc[1]}; {dev.device_kind} has {cc[0]}.{cc[1]}"]
  return []


def half_precision(call: Call, what: str) -> list[str]:
  if call.dtype in HALF:
    return []
  return [f"{what} needs float16 or bfloat16 q/k/v; got {call.dtype.name} "
          "(cast the inputs, e.g. the layer's dtype=jnp.bfloat16, or use backend='xla' for float32)"]


def fused_only(call: Call, name: str) -> list[str]:
  """A fused kernel never materialises the weights, so it cannot return, drop out or re-precision them."""
  reasons = []
  if call.return_weights:
    reasons.append(f"{name} never materialises the attention weights, so it cannot return or sow them; only 'naive' can")
  if call.dropout:
    reasons.append(f"{name} has no dropout on the attention weights; only 'naive' applies it")
  if call.precision is not None:
    reasons.append(f"{name} accumulates in float32 and takes no precision= ({call.precision}); only 'naive' honours it")
  return reasons
