"""cuDNN's FP8 flash attention behind a bf16/fp16 interface, with per-tensor scaling.

jax reaches cuDNN's FP8 attention only through its private module
`jax._src.cudnn.fused_attention_stablehlo`; this file is the one place that touches it, and
`api_problem()` says so plainly when an installed jax changed those entry points.

Scaling here is current (per tensor, recomputed on every call, so no state); _fp8_delayed
takes q/k/v scales from an amax history instead, under the same rule for P and O:
  q, k, v   amax measured now; scale = the largest power of two with amax * scale <= 448
            (E4M3's max), so dequantising back to bf16 is exact.
  P         softmax probabilities are <= 1: scale 448 uses E4M3's whole range.
  O         every output row is a convex combination of V's rows, so |O| <= amax(v); one
            binade of margin covers P's own FP8 rounding.
Forward: cuDNN FP8 kernel (Q.K^T and P.V as FP8 GEMMs, fp32 softmax). Backward: cuDNN's
bf16 flash backward, fed by the FP8 forward's own softmax statistics and the dequantised
tensors, so nothing is recomputed. cuDNN's FP8 backward also exists (benchmarks/fp8.py times
both); its dP scale would need an amax history of dP, so both cores use the bf16 one.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

try:  # private: the only route from jax to cuDNN's FP8 attention
  from jax._src.cudnn import fused_attention_stablehlo as _fa
except ImportError:
  _fa = None

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
_BTNH = 0  # AttentionLayout.BTNH in jax's module

MIN_CC = (9, 0)  # cuDNN's FP8 flash attention: Hopper and Blackwell (9.x, 10.x); not 12.x

# The private primitives we bind, positionally, and the argument names of the functions they
# run (their impl, which jax also lowers through custom_partitioning, and their abstract
# evaluation): the guard checks exactly these, so a reordered argument list is caught.
_API = {
    "_dot_product_attention_fp8_fwd_p_wrapper": (
        "query", "key", "value", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o",
        "scale", "use_causal_mask", "layout", "is_training"),
    "_dot_product_attention_bwd_p_wrapper": (
        "query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
        "page_table_v", "activation", "fwd_output", "grad_output", "scale", "seed", "dropout_rate",
        "variadic_args", "mask_type", "layout", "sliding_window_length"),
    "_dot_product_attention_fp8_bwd_p_wrapper": (
        "query", "key", "value", "fwd_output", "grad_output", "activation", "descale_q", "descale_k", "descale_v",
        "descale_o", "descale_dO", "descale_s", "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV",
        "scale_dP", "scale", "use_causal_mask", "layout"),
}


def _rules(primitive_name: str):
  """The functions a wrapper primitive runs: its impl and its abstract evaluation rule."""
  stem = primitive_name.removesuffix("_p_wrapper")
  return getattr(_fa, primitive_name, None), getattr(_fa, stem + "_impl", None), getattr(_fa, stem + "_abstract", None)


@functools.cache
def api_problem() -> str | None:
  """None when this jax has the private cuDNN primitives we bind, taking arguments as we pass them; else why not."""
  if _fa is None or getattr(getattr(_fa, "AttentionLayout", None), "BTNH", None) is None \
      or _fa.AttentionLayout.BTNH.value != _BTNH:
    return f"jax {jax.__version__} has no jax._src.cudnn.fused_attention_stablehlo as attnlayers knows it"
  for name, want in _API.items():
    primitive, impl, abstract = _rules(name)
    if primitive is None or getattr(primitive, "impl", None) is not impl or impl is None or abstract is None:
      return (f"jax {jax.__version__} changed its private cuDNN attention primitive {name} (its impl or abstract "
              "rule moved), which the FP8 core binds; attnlayers supports jax 0.10-0.12")
    for fn in (impl, abstract):
      got = tuple(inspect.signature(fn).parameters)
      if got != want:
        return (f"jax {jax.__version__} changed the arguments of {fn.__name__}, which {name} runs and the FP8 core "
                f"binds positionally: {got} instead of {want}; attnlayers supports jax 0.10-0.12")
  return None


def _meta(x):
  return jnp.reshape(x, (1, 1, 1, 1)).astype(jnp.float32)


def pow2_scale(amax):
  """The largest power of two `scale` with amax * scale <= 448 (amax float32, any shape; below 2^-60 counts as 2^-60)."""
  return jnp.exp2(jnp.floor(jnp.log2(E4M3_MAX / jnp.maximum(amax, 2.0**-60))))


def _quantize(x):
  """x -> (E4M3 x * scale, scale) with scale a power of two and max|x| * scale <= 448."""
  scale = pow2_scale(jnp.max(jnp.abs(x)).astype(jnp.float32))
  return (x.astype(jnp.float32) * scale).astype(E4M3), scale  # float32: fp16 cannot hold every 2^n


def fp8_forward(q8, k8, v8, descales, scale_o, *, scale: float, is_causal: bool, training: bool):
  """The bare cuDNN FP8 kernel: (O in E4M3, amax_s, amax_o[, softmax stats (B, N, T)])."""
  dq, dk, dv = descales
  return _fa._dot_product_attention_fp8_fwd_p_wrapper.bind(
      q8, k8, v8, _meta(dq), _meta(dk), _meta(dv), _meta(1 / E4M3_MAX), _meta(E4M3_MAX), _meta(scale_o),
      scale=scale, use_causal_mask=is_causal, layout=_BTNH, is_training=training)


def bf16_backward(q, k, v, stats, out, dout, *, scale: float, is_causal: bool):
  """cuDNN's bf16/fp16 flash backward from saved statistics: (dq, dk, dv)."""
  unused = jnp.zeros((0,), q.dtype)
  mask_type = _fa.MaskType.CAUSAL if is_causal else _fa.MaskType.NO_MASK
  grads = _fa._dot_product_attention_bwd_p_wrapper.bind(
      q, k, v, unused, unused, unused, unused, unused, unused, unused, stats, out, dout,
      scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask_type,
      layout=_BTNH, sliding_window_length=None)
  return grads[0], grads[1], grads[2]


def fp8_backward(q8, k8, v8, o8, do8, stats, *, scale: float, is_causal: bool):
  """cuDNN's FP8 flash backward with unit scales: (dq, dk, dv) in E4M3. For benchmarks/fp8.py,
  which times it against bf16_backward; the core does not use it (see the module docstring)."""
  one = _meta(1.0)
  grads = _fa._dot_product_attention_fp8_bwd_p_wrapper.bind(
      q8, k8, v8, o8, do8, stats, *([one] * 12), scale=scale, use_causal_mask=is_causal, layout=_BTNH)
  return grads[0], grads[1], grads[2]


def quantized_forward(q8, k8, v8, scales, dtype, *, scale: float, is_causal: bool):
  """The FP8 forward on quantised q8/k8/v8 (x8 = x * s for scales s = (sq, sk, sv), powers of two):
  (O (B, T, N, H) in `dtype`, the softmax statistics the backward takes). O's scale is sv / 2: |O| <= max|v8| / sv, and the
  2 absorbs P's FP8 rounding. The training kernel runs for every call, a forward alone too: it also writes
  the statistics the backward takes (benchmarks/fp8.py times it against the inference kernel)."""
  sq, sk, sv = scales
  scale_o = sv / 2
  outs = fp8_forward(q8, k8, v8, (1 / sq, 1 / sk, 1 / sv), scale_o, scale=scale, is_causal=is_causal, training=True)
  # float32: 1 / scale_o can pass fp16's range (max|v| below ~7e-6); exact either way, scale_o is 2^n
  return (outs[0].astype(jnp.float32) * (1 / scale_o)).astype(dtype), outs[3]


def quantized_backward(q8, k8, v8, scales, out, stats, dout, *, scale: float, is_causal: bool):
  """cuDNN's bf16 backward from the FP8 forward's residuals: q/k/v dequantised (exact), its statistics."""
  dt = out.dtype
  q, k, v = ((x8.astype(jnp.float32) / s).astype(dt) for x8, s in zip((q8, k8, v8), scales))  # exact: s is 2^n
  return bf16_backward(q, k, v, stats, out, dout.astype(dt), scale=scale, is_causal=is_causal)


def _attention_fwd(q, k, v, scale, is_causal):
  (q8, sq), (k8, sk), (v8, sv) = _quantize(q), _quantize(k), _quantize(v)
  out, stats = quantized_forward(q8, k8, v8, (sq, sk, sv), q.dtype, scale=scale, is_causal=is_causal)
  return out, (q8, k8, v8, (sq, sk, sv), out, stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def attention(q, k, v, scale: float, is_causal: bool):
  """FP8 attention, current scaling: q (B, T, N, H), k/v (B, S, K, H) in bf16/fp16 -> (B, T, N, H) in q's dtype."""
  return _attention_fwd(q, k, v, scale, is_causal)[0]


def _attention_bwd(scale, is_causal, residuals, dout):
  q8, k8, v8, scales, out, stats = residuals
  return quantized_backward(q8, k8, v8, scales, out, stats, dout, scale=scale, is_causal=is_causal)


attention.defvjp(_attention_fwd, _attention_bwd)


def unmet(T: int, S: int, H: int, cc, cudnn_version, *, device: bool = True) -> list[str]:
  """Why cuDNN's FP8 attention cannot take a call (te-fp8 then refuses it, or runs bf16 if told to); device=False:
  not the GPU's and cuDNN's, only the call's own limits and jax's API (api_problem)."""
  reasons = _device_unmet(cc, cudnn_version) if device else []
  if H != 128 or T % 128 or S % 128:
    reasons.append(f"cuDNN FP8 attention (with a backward pass) needs head dim 128 and T, S multiples of 128; "
                   f"got H={H}, T={T}, S={S}")
  problem = api_problem()
  return reasons + ([problem] if problem else [])


def _device_unmet(cc, cudnn_version) -> list[str]:
  reasons = []
  if cc is None or cc[0] not in (9, 10):
    have = "no CUDA GPU" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
    reasons.append(f"cuDNN FP8 attention needs compute capability 9.x or 10.x; {have}")
  if cudnn_version is None or cudnn_version < 90100 or 91000 <= cudnn_version < 91100:
    reasons.append(f"cuDNN FP8 attention needs cuDNN >= 9.1 and not 9.10.x; have {cudnn_version}")
  return reasons
