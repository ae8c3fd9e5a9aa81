"""TransformerEngine fused attention (`transformer_engine.jax.attention.fused_attn`).

q/k/v go in as they are (BSHD_BSHD_BSHD layout, GQA through K < N heads), causal through
TE's top-left CAUSAL_MASK, no dropout. TransformerEngine is imported only inside this
module and only when a GPU call is checked or run, so attnlayers imports without it.
Whether TE has a fused kernel for a call is TE's own answer (is_fused_attn_kernel_available).
TE's boolean masks mean True = masked out, the inverse of ours; rather than invert them we
hand TE a mask as what it means, a post-scale bias (0 where ours is True, a large negative
number where it is False), added to any bias of the call. That bias keeps its batch dim
(1 or B) and is broadcast to (N, T, S), the shapes TE's fused kernel takes.

Per-row lengths go in TE's SequenceDescriptor with its PADDING mask types, bottom-right
causality as TE's CAUSAL_BOTTOM_RIGHT masks; a single query at the end of its keys (a
decode step) needs no causal mask, only the padding one (unless a window needs the alignment).

A sliding window is TE's window_size (left, right), cut to (left, 0) with a causal mask (cuDNN's
right bound would replace the causal one). Packed documents (one segment_ids array shared by
queries and keys) run in TE's packed THD layout: each document its own sequence, described by
run ids and positions (backends/_packing), PADDING(_CAUSAL) masks, max_segments sequences per row,
so the kernel skips the other documents' blocks rather than masking them.
"""

from __future__ import annotations

import types

import jax.numpy as jnp

from attnlayers.backends import _masks, _packing, _reasons
from attnlayers.spec import Call, Options

NAME = "te"
SUMMARY = "TransformerEngine fused attention (transformer_engine.jax); GPU, fp16/bf16"
MIN_CC = (8, 0)  # TE's fused attention (cuDNN flash) from Ampere on


def _te():
  from transformer_engine.jax import attention  # lazy: only on a GPU machine with TE
  return attention


def _mask_type(te, call):
  """TE's mask type for a call (a Call, or _shape_of's stand-in): padding where there are lengths."""
  one_query_at_end = call.bottom_right and call.T == 1 and call.window is None  # it sees every real key
  padding = call.has_lengths or one_query_at_end or call.segments  # THD takes padding masks only
  if not call.is_causal or one_query_at_end:
    return te.AttnMaskType.PADDING_MASK if padding else te.AttnMaskType.NO_MASK
  name = ("PADDING_" if padding else "") + "CAUSAL" + ("_BOTTOM_RIGHT" if call.bottom_right else "") + "_MASK"
  return getattr(te.AttnMaskType, name)


def _shape_of(q, k, opts: Options):
  """What _mask_type reads, from the arrays and options of a run."""
  T, S = q.shape[1], k.shape[1]
  return types.SimpleNamespace(is_causal=opts.is_causal, bottom_right=_masks.bottom_right(opts, T, S),
                               has_lengths=opts.has_lengths, T=T, S=S, window=opts.window, segments=opts.has_segments)


def _layout(te, call):
  return te.QKVLayout.THD_THD_THD if call.segments else te.QKVLayout.BSHD_BSHD_BSHD


def _window_size(call):
  """TE's window_size: (left, right) with -1 for a side that spans every key (a query's position is below
  max(T, S), so left >= max(T, S) reaches key 0 from every one), right 0 under a causal mask."""
  if call.window is None:
    return None
  left, right = call.window
  return (-1 if left >= max(call.T, call.S) else left, 0 if call.is_causal else -1 if right >= call.S else right)


def _max_segments(call) -> int:
  return call.max_segments or call.T


def _bias_type(te, has_bias: bool):
  return te.AttnBiasType.POST_SCALE_BIAS if has_bias else te.AttnBiasType.NO_BIAS


def _as_bias(mask, bias, N: int, T: int, S: int, dtype):
  """Our mask (True = attend) and bias as one additive (1|B, N, T, S) bias, or None."""
  if mask is None and bias is None:
    return None
  total = jnp.zeros((1, 1, 1, 1), jnp.float32)
  if bias is not None:
    total = total + bias.reshape((1,) * (4 - bias.ndim) + bias.shape).astype(jnp.float32)
  if mask is not None:
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    total = total + jnp.where(mask, 0.0, 0.5 * float(jnp.finfo(dtype).min))  # masked: exp() underflows to 0
  return jnp.broadcast_to(total, (total.shape[0], N, T, S)).astype(dtype)


def _bias_dims(call: Call) -> dict:
  """The (1|B, N, T, S) bias run() hands TE, as is_fused_attn_kernel_available wants it described."""
  batch = max(shape[0] for shape in (call.mask_shape, call.bias_shape) if shape is not None)
  return dict(bias_batch=batch, bias_heads=call.N, bias_seqlen_q=call.T, bias_seqlen_kv=call.S)


def unmet(call: Call, name: str = NAME) -> list[str]:
  """Why TE's bf16/fp16 fused kernel cannot take the call (te-fp8 asks too, for its bf16 core)."""
  what = "TransformerEngine fused attention"
  reasons = _reasons.nvidia_gpu(call.device, MIN_CC, what) + _reasons.transformer_engine(what)
  reasons += _reasons.half_precision(call, what) + _reasons.fused_only(call, name, exact_half_products=True)
  reasons += _segment_reasons(call, name)
  if reasons:
    return reasons
  te = _te()
  has_bias = call.mask_shape is not None or call.bias_shape is not None
  packed = {"max_segments_per_seq": _max_segments(call)} if call.segments else {}
  available = te.is_fused_attn_kernel_available(
      True, call.B, call.dtype, call.dtype, _layout(te, call), _bias_type(te, has_bias),
      _mask_type(te, call), te.AttnSoftmaxType.VANILLA_SOFTMAX, 0.0, call.N, call.K, call.T, call.S,
      call.H, call.H, window_size=_window_size(call), **(_bias_dims(call) if has_bias else {}), **packed)
  if not available:
    with_bias = " with a mask/bias (as a post-scale bias)" if has_bias else ""
    how = f" {_layout(te, call).name} window_size={_window_size(call)}" if call.segments or call.window else ""
    reasons.append(f"TransformerEngine has no fused kernel for {call.shape_str()} {_mask_type(te, call).name}{with_bias}"
                   f"{how} on this GPU and cuDNN (is_fused_attn_kernel_available is False)")
  return reasons


def _segment_reasons(call: Call, name: str) -> list[str]:
  """What the packed (THD) layout cannot express of a call with segment ids."""
  if not call.segments:
    return []
  reasons = []
  if not call.shared_segments:
    reasons.append(f"{name} runs packed documents from one segment_ids array shared by queries and keys "
                   "(self-attention); a (q, kv) pair runs on 'xla' or 'naive'")
  if call.has_lengths:
    reasons.append(f"{name} takes segment ids without lengths: mark the padding with segment id 0 instead")
  if call.bottom_right:
    reasons.append(f"{name}'s packed layout aligns a bottom-right causal mask per document, not per row; "
                   "use top-left causality with segment ids")
  if call.mask_shape is not None or call.bias_shape is not None:
    reasons.append(f"{name}'s packed layout takes no mask or bias besides the segment ids")
  return reasons


def notes(call: Call) -> list[str]:
  te, out = _te(), []
  if call.segments:
    out.append(f"packed documents: TE's THD layout, {_mask_type(te, call).name}, max_segments_per_seq="
               f"{_max_segments(call)} (each document one run of its id; rows where one is not, NaN)")
  elif call.has_lengths or call.bottom_right:
    out.append(f"TE mask type {_mask_type(te, call).name} with a SequenceDescriptor of the lengths")
  if call.window is not None:
    out.append(f"sliding window: TE window_size={_window_size(call)}")
  return out


def run(q, k, v, opts: Options):
  te = _te()
  (B, T, N, _), S = q.shape, k.shape[1]
  call = _shape_of(q, k, opts)
  if opts.has_segments:
    return _run_packed(te, q, k, v, opts, call)
  # A row with no queries or no keys gets length 1 here: TE's backward gives NaN dk for such rows (measured,
  # TE 2.20.2 MHA). finish() zeroes that row's outputs, so its gradients are exactly zero as the rule says.
  lengths = te.SequenceDescriptor.from_seqlens(tuple(jnp.maximum(x, 1) for x in _masks.lengths(opts, B, T, S)))
  bias = _as_bias(opts.mask, opts.bias, N, T, S, q.dtype)  # (1|B, N, T, S) or None
  out = te.fused_attn((q, k, v), bias, lengths, None, attn_bias_type=_bias_type(te, bias is not None),
                      qkv_layout=te.QKVLayout.BSHD_BSHD_BSHD, **_shared_args(te, opts, call))
  return _masks.finish(out, opts, S)


def _shared_args(te, opts: Options, call) -> dict:
  """The fused_attn arguments of both layouts: mask type, softmax, scale, no dropout, training, window."""
  return {"attn_mask_type": _mask_type(te, call), "softmax_type": te.AttnSoftmaxType.VANILLA_SOFTMAX,
          "scaling_factor": opts.scale, "dropout_probability": 0.0, "is_training": True,
          "window_size": _window_size(call)}


def _run_packed(te, q, k, v, opts: Options, call):
  """Segment ids (one array, T == S) as TE's THD descriptor of run ids and positions in the run."""
  M = opts.max_segments or q.shape[1]
  rid, pos, ok = _packing.runs(opts.q_segment_ids, M)  # (B, T), (B, T), (B,)
  _packing.check_concrete(ok, NAME)
  desc = te.SequenceDescriptor.from_segment_ids_and_pos(rid, pos)
  out = te.fused_attn((q, k, v), None, desc, None, attn_bias_type=te.AttnBiasType.NO_BIAS,
                      qkv_layout=te.QKVLayout.THD_THD_THD, max_segments_per_seq=M, **_shared_args(te, opts, call))
  return _packing.poison(_masks.finish(out, opts, k.shape[1]), ok)
