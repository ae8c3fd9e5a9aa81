"""Requirements several backends share, each returning the unmet ones as readable reasons."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attnlayers import device as device_lib
from attnlayers.spec import Call

HALF = (np.dtype("float16"), np.dtype("bfloat16"))


class Reason(str):
  """One unmet requirement in words, and where changing one argument of the call meets it, which and to what.

  Attributes:
    argument: that argument's name (attention()'s, or "dtype" for q/k/v's), or None.
    expected: the value, or values in words, that would work.
  """
  argument: str | None
  expected: str | None

  def __new__(cls, text: str, argument: str | None = None, expected: str | None = None):
    reason = super().__new__(cls, text)
    reason.argument, reason.expected = argument, expected
    return reason


def nvidia_gpu(dev: device_lib.DeviceInfo, min_cc: tuple[int, int], what: str) -> list[str]:
  if not dev.is_cuda:
    return [f"{what} needs an NVIDIA GPU with compute capability >= {min_cc[0]}.{min_cc[1]}; "
            f"the call's device is {dev.describe()} (use backend='xla' or 'naive' there)"]
  if dev.compute_capability < min_cc:
    cc = dev.compute_capability
    return [f"{what} needs compute capability >= {min_cc[0]}.{min_cc[1]}; {dev.device_kind} has {cc[0]}.{cc[1]}"]
  return []


def transformer_engine(what: str) -> list[str]:
  if device_lib.has_module("transformer_engine"):
    return []
  return [f"TransformerEngine is not installed: pip install 'attnlayers[te]' (transformer-engine[jax], needs CUDA "
          f"and a GPU to build); {what} runs on it"]


def is_narrow_float(dtype: np.dtype) -> bool:
  """A float of fewer than 16 bits (jax's float8_* and float4_* types): jax promotes none of them implicitly,
  and of our backends only 'naive' runs them as q/k/v."""
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 2


def half_precision(call: Call, what: str) -> list[str]:
  if call.dtype in HALF:
    return []
  if np.issubdtype(call.dtype, np.complexfloating):
    return [Reason(f"{what} takes no complex inputs (got {call.dtype.name}); use backend='naive'")]
  if is_narrow_float(call.dtype):
    return [Reason(f"{what} needs float16 or bfloat16 q/k/v; got {call.dtype.name}, which only 'naive' runs (use "
                   "backend='naive', or cast the inputs to bfloat16)", "dtype", "bfloat16")]
  return [Reason(f"{what} needs float16 or bfloat16 q/k/v; got {call.dtype.name} "
                 "(cast the inputs, e.g. the layer's dtype=jnp.bfloat16, or use backend='xla' for float32)",
                 "dtype", "float16 or bfloat16")]


def is_default_precision(precision) -> bool:
  """Whether a jax PrecisionLike asks for nothing beyond the default: None, DEFAULT (or "default"), a pair of
  them, or DotAlgorithmPreset.DEFAULT. Any other preset, or a DotAlgorithm, names an algorithm: not default."""
  if precision is None:
    return True
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return precision == jax.lax.DotAlgorithmPreset.DEFAULT
  if isinstance(precision, jax.lax.DotAlgorithm):
    return False
  values = precision if isinstance(precision, tuple) else (precision,)
  return all(p is None or jax.lax.Precision(p) == jax.lax.Precision.DEFAULT for p in values)


def is_dot_algorithm(precision) -> bool:
  """Whether a jax PrecisionLike names a dot algorithm (a preset other than DEFAULT, or a DotAlgorithm): it sets
  the matmuls' input types and accumulation, which a Precision level on fp16/bf16 inputs never changes."""
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    return precision != jax.lax.DotAlgorithmPreset.DEFAULT
  return isinstance(precision, jax.lax.DotAlgorithm)


def fused_only(call: Call, name: str, *, exact_half_products: bool) -> list[str]:
  """What no fused kernel does: no_weights_or_dropout, then fused_precision."""
  return no_weights_or_dropout(call, name) + fused_precision(call, name, exact_half_products=exact_half_products)


def no_weights_or_dropout(call: Call, name: str) -> list[str]:
  """A fused kernel never materialises the weights, so it cannot return or drop them out."""
  reasons = []
  if call.return_weights:
    reasons.append(f"{name} never materialises the attention weights, so it cannot return or sow them; only 'naive' can")
  if call.dropout:
    reasons.append(f"{name} has no dropout on the attention weights; only 'naive' applies it")
  return reasons


def fused_precision(call: Call, name: str, *, exact_half_products: bool) -> list[str]:
  """A fused kernel applies a matmul Precision level only where its inputs are fp16/bf16, whose products it
  accumulates exactly in float32. A dot algorithm it never applies: its kernel picks its own input types and
  accumulation, whatever the inputs."""
  if is_dot_algorithm(call.precision):
    return [f"{name} cannot apply precision={call.precision}: a dot algorithm sets the attention matmuls' "
            f"input types and accumulation, which {name}'s fused kernel does not take; only 'naive' applies it "
            "(or leave precision=None)"]
  if not is_default_precision(call.precision) and not (exact_half_products and call.dtype in HALF):
    return [f"{name} cannot apply precision={call.precision} to {call.dtype.name} attention matmuls; "
            "only 'naive' honours it (or leave precision=None)"]
  return []


def no_segments_or_window(call: Call, name: str, others: str) -> list[str]:
  """For kernels that take no segment ids or sliding window: the refusal, per feature."""
  asked = [what for what, on in (("segment ids (packed documents)", call.segments),
                                 (f"a sliding window {call.window}", call.window is not None)) if on]
  if not asked:
    return []
  return [f"{name} does not run {' or '.join(asked)}; {others}"]
