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

import dataclasses

import jax.numpy as jnp

from attnlayers.backends import _masks, _packing, _reasons
from attnlayers.spec import Call

NAME = "te"
SUMMARY = "TransformerEngine fused attention (transformer_engine.jax); GPU, fp16/bf16"
MIN_CC = (8, 0)  # TE's fused attention (cuDNN flash) from Ampere on


def _te():
  from transformer_engine.jax import attention  # lazy: only on a GPU machine with TE
  return attention


@dataclasses.dataclass(frozen=True)
class Decision:
  """How run() hands a call to TE's fused_attn. TE's enums by member name: TE is imported only to run."""
  mask_type: str  # an AttnMaskType: PADDING_ where there are lengths or segments, causal as aligned
  layout: str  # a QKVLayout: THD_THD_THD for packed documents, else BSHD_BSHD_BSHD
  window_size: tuple[int, int] | None  # (left, right), -1 for a side that spans every key; None: no window
  bias: bool  # the caller's mask and bias go in as one post-scale bias
  max_segments_per_seq: int | None  # packed: sequences per row (max_segments, or T); else None


def decide(call: Call) -> Decision:
  """TE's settings for a call. One query at the end of its keys (a decode step) sees every real key, so it
  takes the padding mask alone. A window is (left, right) with -1 for a side that spans every key (a query's
  position is below max(T, S), so left >= max(T, S) reaches key 0 from every one), right 0 under a causal mask
  (cuDNN's right bound would replace the causal one)."""
  one_query_at_end = call.bottom_right and call.T == 1 and call.window is None
  padding = call.has_lengths or one_query_at_end or call.segments  # THD takes padding masks only
  if not call.is_causal or one_query_at_end:
    mask_type = "PADDING_MASK" if padding else "NO_MASK"
  else:
    mask_type = ("PADDING_" if padding else "") + "CAUSAL" + ("_BOTTOM_RIGHT" if call.bottom_right else "") + "_MASK"
  window = None
  if call.window is not None:
    left, right = call.window
    window = (-1 if left >= max(call.T, call.S) else left, 0 if call.is_causal else -1 if right >= call.S else right)
  return Decision(mask_type, "THD_THD_THD" if call.segments else "BSHD_BSHD_BSHD", window,
                  bias=call.mask_shape is not None or call.bias_shape is not None,
                  max_segments_per_seq=(call.max_segments or call.T) if call.segments else None)


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
  te, d = _te(), decide(call)
  packed = {"max_segments_per_seq": d.max_segments_per_seq} if call.segments else {}
  available = te.is_fused_attn_kernel_available(
      True, call.B, call.dtype, call.dtype, getattr(te.QKVLayout, d.layout), _bias_type(te, d.bias),
      getattr(te.AttnMaskType, d.mask_type), te.AttnSoftmaxType.VANILLA_SOFTMAX, 0.0, call.N, call.K, call.T, call.S,
      call.H, call.H, window_size=d.window_size, **(_bias_dims(call) if d.bias else {}), **packed)
  if not available:
    with_bias = " with a mask/bias (as a post-scale bias)" if d.bias else ""
    how = f" {d.layout} window_size={d.window_size}" if call.segments or call.window else ""
    reasons.append(f"TransformerEngine has no fused kernel for {call.shape_str()} {d.mask_type}{with_bias}"
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


def notes(call: Call, decision: Decision) -> list[str]:
  out = []
  if call.segments:
    out.append(f"packed documents: TE's THD layout, {decision.mask_type}, max_segments_per_seq="
               f"{decision.max_segments_per_seq} (each document one run of its id; rows where one is not, NaN)")
  elif call.has_lengths or call.bottom_right:
    out.append(f"TE mask type {decision.mask_type} with a SequenceDescriptor of the lengths")
  if call.window is not None:
    out.append(f"sliding window: TE window_size={decision.window_size}")
  return out


def run(q, k, v, call: Call, decision: Decision):
  te = _te()
  args = {"attn_mask_type": getattr(te.AttnMaskType, decision.mask_type),
          "softmax_type": te.AttnSoftmaxType.VANILLA_SOFTMAX, "scaling_factor": call.scale,
          "dropout_probability": 0.0, "is_training": True, "window_size": decision.window_size}
  if call.segments:
    return _run_packed(te, q, k, v, call, decision.max_segments_per_seq, args)
  # A row with no queries or no keys gets length 1 here: TE's backward gives NaN dk for such rows. finish()
  # zeroes that row's outputs, so its gradients are exactly zero as the rule says.
  lengths = te.SequenceDescriptor.from_seqlens(tuple(jnp.maximum(x, 1) for x in _masks.lengths(call)))
  bias = (_as_bias(_masks.caller_mask(call), _masks.finite_bias(call), call.N, call.T, call.S, q.dtype)
          if decision.bias else None)  # (1|B, N, T, S); the bias's -inf keys as masked ones
  out = te.fused_attn((q, k, v), bias, lengths, None, attn_bias_type=_bias_type(te, decision.bias),
                      qkv_layout=te.QKVLayout.BSHD_BSHD_BSHD, **args)
  return _masks.finish(out, call)


def _run_packed(te, q, k, v, call: Call, M: int, args: dict):
  """Segment ids (one array, T == S) as TE's THD descriptor of run ids and positions in the run; M runs a row."""
  rid, pos, ok = _packing.runs(call.q_segment_ids, M)  # (B, T), (B, T), (B,)
  _packing.check_concrete(ok, NAME)
  desc = te.SequenceDescriptor.from_segment_ids_and_pos(rid, pos)
  out = te.fused_attn((q, k, v), None, desc, None, attn_bias_type=te.AttnBiasType.NO_BIAS,
                      qkv_layout=te.QKVLayout.THD_THD_THD, max_segments_per_seq=M, **args)
  return _packing.poison(_masks.finish(out, call), ok)
