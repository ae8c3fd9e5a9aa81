"""cuDNN fused (flash) attention: `jax.nn.dot_product_attention(implementation="cudnn")`.

Never builds the (B, N, T, S) scores; causal blocks above the diagonal are skipped.
Needs an NVIDIA GPU (compute capability >= 8.0), float16/bfloat16, and a head dim that
is a multiple of 8 up to 128 (256 on Hopper and later). A boolean mask reaches cuDNN as
an additive bias, which cuDNN wants at full (T, S) size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlayers.backends import _reasons
from attnlayers.spec import Call, Options

NAME = "cudnn"
SUMMARY = "jax.nn.dot_product_attention(implementation='cudnn'); flash attention, GPU, fp16/bf16"
MIN_CC = (8, 0)


def max_head_dim(call: Call) -> int:
  cc = call.device.compute_capability
  return 256 if cc is not None and cc >= (9, 0) else 128


def unmet(call: Call) -> list[str]:
  reasons = _reasons.nvidia_gpu(call.device, MIN_CC, "cuDNN fused attention")
  if call.device.is_cuda and call.device.cudnn_version is None:
    reasons.append("cuDNN is not loaded by jax on this machine (install jax[cuda12] or jax[cuda13])")
  reasons += _reasons.half_precision(call, "cuDNN fused attention")
  h_max = max_head_dim(call)
  if call.H % 8 or call.H > h_max:
    where = f"on {call.device.describe()}" if call.device.is_cuda else "(256 from compute capability 9.0)"
    reasons.append(f"cuDNN needs a head dim that is a multiple of 8 and <= {h_max} {where}; got H={call.H}")
  has_bias = call.mask_shape is not None or call.bias_shape is not None
  if has_bias and (call.T % 2 or call.S % 2):
    reasons.append(f"cuDNN with a mask or bias needs even T and S (its backward pass requires it); got T={call.T}, S={call.S}")
  return reasons + _reasons.fused_only(call, NAME, exact_half_products=True)


def _full_ts(x, T: int, S: int):
  """cuDNN takes bias/mask with full (T, S) dims; batch and head dims may stay 1."""
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  return jnp.broadcast_to(x, x.shape[:2] + (T, S))


def run(q, k, v, opts: Options):
  T, S = q.shape[1], k.shape[1]
  mask = None if opts.mask is None else _full_ts(opts.mask, T, S)
  bias = None if opts.bias is None else _full_ts(opts.bias, T, S).astype(q.dtype)
  return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=opts.scale,
                                      is_causal=opts.is_causal, implementation="cudnn")
