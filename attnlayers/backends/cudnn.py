"""cuDNN fused (flash) attention: `jax.nn.dot_product_attention(implementation="cudnn")`.

Never builds the (B, N, T, S) scores; causal blocks above the diagonal are skipped.
Needs an NVIDIA GPU (compute capability >= 8.0), float16/bfloat16, and a head dim that
is a multiple of 8 up to 128 (256 on Hopper and later). A boolean mask reaches cuDNN as
an additive bias, which cuDNN wants at full (T, S) size.

Per-row lengths go to cuDNN's padding mask (jax's query_seq_lengths/key_value_seq_lengths),
with its top-left causal mask where asked. jax exposes no bottom-right causal mask: a
one-query call (a decode step) needs none, since its query sees every real key; a longer
query block at the end of the keys (a prefill chunk into a KV cache) runs with the rule as a
(B, 1, T, S) mask, which explain() says.

A causal sliding window (left, right) goes to cuDNN's band as local_window_size=(left, 0) (the
causal mask cuts the right side), so blocks outside it are skipped. jax's cuDNN path has no
right bound: a non-causal window raises there, or (left, 0) without is_causal silently attends
to later keys (jax PR #39576), so non-causal windows are refused, as are windows that need a
per-row alignment (bottom-right, lengths with a mask). Segment ids are refused: jax exposes
cuDNN's packed layout only in a private module; backend='te' runs them packed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attnlayers.backends import _masks, _reasons
from attnlayers.spec import Call

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
  as_mask = decide(call).masks == "rule"
  has_bias = call.mask_shape is not None or call.bias_shape is not None or as_mask
  if has_bias and (call.T % 2 or call.S % 2):
    why = " (bottom-right causal or lengths with a mask become one)" if as_mask else ""
    reasons.append(f"cuDNN with a mask or bias{why} needs even T and S (its backward pass requires it); "
                   f"got T={call.T}, S={call.S}")
  return reasons + _reasons.fused_only(call, NAME, exact_half_products=True) + _window_reasons(call)


def _window_reasons(call: Call) -> list[str]:
  reasons = []
  if call.segments:
    reasons.append("cuDNN through jax takes no segment ids (jax keeps cuDNN's packed layout private); backend='te' "
                   "runs packed documents in its THD layout, 'xla' and 'naive' with a mask")
  if call.window is None:
    return reasons
  if not call.is_causal:
    reasons.append(f"cuDNN through jax runs only causal sliding windows: it has no right bound, and a non-causal "
                   f"window {call.window} either raises in jax or attends to later keys (jax PR #39576); "
                   "backend='te' takes (left, right) windows")
  elif call.bottom_right or decide(call).masks == "rule":
    reasons.append("cuDNN's sliding window is aligned top-left; bottom-right causality (a KV cache) or lengths "
                   "together with a mask need another alignment: backend='te' or 'xla'")
  return reasons


@dataclasses.dataclass(frozen=True)
class Decision:
  """How run() hands a call to jax's cuDNN attention."""
  masks: str  # "native": is_causal, mask and bias as given; "lengths": cuDNN's padding mask from the lengths;
  # "rule": lengths, causality and the caller's mask as one (B, 1, T, S) mask (an additive bias in cuDNN)
  causal: bool  # cuDNN's own causal mask (top-left)
  window: tuple[int, int] | None  # local_window_size: (left, 0), the causal mask cuts the right side
  forward_only: bool  # one query with a padding mask: jax's cuDNN backward refuses T = 1
  finish: bool  # _masks.finish zeroes the rows the kernel leaves with no key


def decide(call: Call) -> Decision:
  """The rule reaches cuDNN as one mask where jax has no mask type for it: bottom-right causal beyond one
  query, or lengths together with the caller's mask or bias. Else cuDNN's own masks take it."""
  user = call.mask_shape is not None or call.bias_shape is not None
  if (call.bottom_right and call.T > 1) or (call.has_lengths and user):
    return Decision("rule", causal=False, window=None, forward_only=False, finish=True)
  window = None if call.window is None else (call.window[0], 0)  # causal (unmet): the right side is cut at p
  if not call.has_lengths and not call.bottom_right:
    return Decision("native", call.is_causal, window, forward_only=False,  # rows the mask, a -inf bias or the
                    finish=user or window is not None)  # window empties: zeros
  # bottom-right here is one query (T == 1), which sees every real key: the padding mask alone
  return Decision("lengths", call.is_causal and not call.bottom_right, window, forward_only=call.T == 1, finish=True)


def notes(call: Call, decision: Decision) -> list[str]:
  if decision.masks == "rule":
    return ["lengths and causality as a (B, 1, T, S) mask (an additive bias in cuDNN): jax exposes no bottom-right "
            "causal mask, nor lengths together with a bias"]
  if call.bottom_right:  # T == 1
    return ["one query at the end of its keys: cuDNN's padding mask (key_value_seq_lengths) alone"]
  window = [f"sliding window: cuDNN's band, local_window_size={decision.window}"] if decision.window else []
  if decision.masks == "lengths":
    return ["cuDNN padding mask from query_seq_lengths / key_value_seq_lengths" + (", causal top-left" if call.is_causal else "")] + window
  return window


def _full_ts(x, T: int, S: int):
  """cuDNN takes bias/mask with full (T, S) dims; batch and head dims may stay 1."""
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  return jnp.broadcast_to(x, x.shape[:2] + (T, S))


def run(q, k, v, call: Call, decision: Decision):
  T, S = call.T, call.S
  bias = None if call.bias is None else _full_ts(_masks.finite_bias(call), T, S).astype(q.dtype)  # -inf: in the mask
  if decision.masks == "rule":
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=_full_ts(_masks.allowed(call), T, S),
                                       scale=call.scale, implementation="cudnn")
  elif decision.masks == "native":
    mask = _masks.caller_mask(call)
    mask = None if mask is None else _full_ts(mask, T, S)
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=call.scale, is_causal=decision.causal,
                                       local_window_size=decision.window, implementation="cudnn")
  else:
    q_len, kv_len = _masks.lengths(call)
    padded = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len, scale=call.scale, is_causal=decision.causal,
        local_window_size=decision.window, implementation="cudnn")
    out = _forward_only(padded, q, k, v) if decision.forward_only else padded(q, k, v)
  return _masks.finish(out, call) if decision.finish else out


def _forward_only(fn, q, k, v):
  """fn(q, k, v), whose gradient raises: jax's cuDNN attention runs one query with a padding mask (a decode
  step) forward, but its backward refuses T=1 ("Unsupported sequence length Q 1")."""
  @jax.custom_vjp
  def f(q, k, v):
    return fn(q, k, v)

  def bwd(_, g):
    raise NotImplementedError(
        f"cuDNN attention through jax has no backward pass for one query (T=1) with per-row lengths or bottom-right "
        f"causality, a decode step's shape (q {q.shape}, k {k.shape}); differentiate it on backend='te' or 'xla'")

  f.defvjp(lambda q, k, v: (fn(q, k, v), None), bwd)
  return f(q, k, v)
