"""XLA's own attention: `jax.nn.dot_product_attention(implementation="xla")`.

Runs on every platform for bfloat16 and float32 q/k/v, and off the CPU for float16 (jax asks XLA for the
F16_F16_F32 dot algorithm, which XLA's CPU backend refuses under jit); not for float8/float4
ones, which jax will not promote to its float32 scores ('naive' runs those), nor complex ones, nor float64 ones,
whose softmax jax computes in float32 (their output would be float64 of float32 precision). On a
GPU, XLA fuses what it can but still builds the (B, N, T, S) scores in memory.
"""

from __future__ import annotations

import jax
import numpy as np

from attnlayers.backends import _masks, _reasons
from attnlayers.spec import Call

NAME = "xla"
SUMMARY = "jax.nn.dot_product_attention(implementation='xla'); any platform; bfloat16, float32, float16 off the CPU"
MIN_CC = None  # runs on any device jax runs on


def unmet(call: Call) -> list[str]:
  reasons = _reasons.fused_only(call, NAME, exact_half_products=True)
  if call.dtype.kind == "c":  # jax casts the scores to float32 before its softmax
    reasons.append(f"jax's XLA attention drops the imaginary part of the scores before its softmax (it casts them "
                   f"to float32), so it cannot run {call.dtype.name} q/k/v; 'naive' runs them, with the softmax of "
                   "the complex scores, as Flax's attention computes it where it builds the weights (linen's "
                   "layers always; nnx's with sow_weights or a dropout_rate, else it calls this XLA attention)")
  if call.dtype == np.float64:  # jax casts the scores to float32 before its softmax
    reasons.append("jax's XLA attention computes its softmax in float32 whatever the inputs, so float64 q/k/v would "
                   "come back as float64 of float32 precision; 'naive' runs them with scores and softmax in float64, "
                   "or cast the inputs to float32")
  if _reasons.is_narrow_float(call.dtype):  # jax computes the scores in promote_types(dtype, float32)
    reasons.append(f"jax's XLA attention promotes q/k/v with float32 for its scores, which jax refuses for "
                   f"{call.dtype.name} (it promotes no float narrower than 16 bits implicitly), so it cannot run "
                   f"{call.dtype.name} q/k/v; 'naive' runs them (scores and softmax in float32), or cast the inputs "
                   "to bfloat16")
  if call.dtype == np.float16 and call.device.platform == "cpu":  # jax asks for this dot algorithm for float16
    reasons.append("jax's XLA attention computes float16 scores with the dot algorithm F16_F16_F32, which XLA's CPU "
                   "backend does not run (under jit jax raises 'The precision 'F16_F16_F32' is not supported by "
                   "dot_general on CPU'), so it cannot run float16 q/k/v on a CPU; 'naive' runs them (scores and "
                   "softmax in float32), or cast the inputs to bfloat16 or float32")
  if call.bias_dtype is not None and _reasons.is_narrow_float(call.bias_dtype):  # added to those float32 scores
    reasons.append(f"jax's XLA attention adds the bias to its float32 scores, a promotion jax refuses for a "
                   f"{call.bias_dtype.name} bias, so it cannot take one; 'naive' takes it (it adds the bias in "
                   "float32), or cast the bias to q's dtype")
  return reasons


def run(q, k, v, call: Call, decision=None):
  if _masks.plain(call):  # top-left causality and the mask as jax takes them
    mask = _masks.caller_mask(call)  # with the bias's -inf keys: a row of them is not NaN
    out = jax.nn.dot_product_attention(q, k, v, bias=call.bias, mask=mask, scale=call.scale,
                                       is_causal=call.is_causal, implementation="xla")
    return out if mask is None else _masks.finish(out, call)  # rows the mask or bias empties: zeros
  out = jax.nn.dot_product_attention(q, k, v, bias=call.bias, mask=_masks.allowed(call), scale=call.scale,
                                     implementation="xla")  # lengths, causality, segments, window: one mask
  return _masks.finish(out, call)
