"""TransformerEngine fused attention (`transformer_engine.jax.attention.fused_attn`).

q/k/v go in as they are (BSHD_BSHD_BSHD layout, GQA through K < N heads), causal through
TE's top-left CAUSAL_MASK, no dropout. TransformerEngine is imported only inside this
module and only when a GPU call is checked or run, so attnlayers imports without it.
Whether TE has a fused kernel for a call is TE's own answer (is_fused_attn_kernel_available).
Boolean masks and additive biases are not wired to TE yet: such calls name `cudnn`.
"""

from __future__ import annotations

import jax.numpy as jnp

from attnlayers import device as device_lib
from attnlayers.backends import _reasons
from attnlayers.spec import Call

NAME = "te"
SUMMARY = "TransformerEngine fused attention (transformer_engine.jax); GPU, fp16/bf16"
INSTALL = "pip install 'attnlayers[te]' (transformer-engine[jax], needs CUDA and a GPU to build)"


def te_requirements(call: Call, min_cc: tuple[int, int], what: str) -> list[str]:
  reasons = _reasons.nvidia_gpu(call, min_cc, what)
  if not device_lib.has_module("transformer_engine"):
    reasons.append(f"TransformerEngine is not installed: {INSTALL}")
  return reasons + _reasons.half_precision(call, what)


def _te():
  from transformer_engine.jax import attention  # lazy: only on a GPU machine with TE
  return attention


def _mask_type(te, is_causal: bool):
  return te.AttnMaskType.CAUSAL_MASK if is_causal else te.AttnMaskType.NO_MASK


def unmet(call: Call) -> list[str]:
  reasons = te_requirements(call, (8, 0), "TransformerEngine fused attention")
  if call.mask_shape is not None or call.bias_shape is not None:
    reasons.append("te takes no mask= or bias= yet (causal only); use backend='cudnn' for masked calls")
  reasons += _reasons.fused_only(call, NAME)
  if reasons:
    return reasons
  te = _te()
  available = te.is_fused_attn_kernel_available(
      True, call.B, call.dtype, call.dtype, te.QKVLayout.BSHD_BSHD_BSHD, te.AttnBiasType.NO_BIAS,
      _mask_type(te, call.is_causal), te.AttnSoftmaxType.VANILLA_SOFTMAX, 0.0, call.N, call.K, call.T, call.S,
      call.H, call.H)
  if not available:
    reasons.append(f"TransformerEngine has no fused kernel for {call.shape_str()} causal={call.is_causal} "
                   "on this GPU and cuDNN (is_fused_attn_kernel_available is False)")
  return reasons


def run(q, k, v, *, scale: float, is_causal: bool = False, mask=None, bias=None):
  te = _te()
  B, T, S = q.shape[0], q.shape[1], k.shape[1]
  lengths = te.SequenceDescriptor.from_seqlens((jnp.full((B,), T, jnp.int32), jnp.full((B,), S, jnp.int32)))
  return te.fused_attn(
      (q, k, v), None, lengths, None, attn_bias_type=te.AttnBiasType.NO_BIAS,
      attn_mask_type=_mask_type(te, is_causal), qkv_layout=te.QKVLayout.BSHD_BSHD_BSHD,
      softmax_type=te.AttnSoftmaxType.VANILLA_SOFTMAX, scaling_factor=scale, dropout_probability=0.0,
      is_training=True)
