"""A block's decode step of one token per row in few kernels: what models.gpt.Block runs for it on the Pallas
kernels.

Letters: B rows, D features, N query heads, K key/value heads, H head dim, L cache positions.

A step of one token per row computes, per block, what Block's general path computes for it:
  s = x + y, q/k/v = LayerNorm1(s) @ (wq | wk | wv) + biases  -> models.ops.norm_gemm.norm_qkv, which also
                                                                 writes k and v into the KV cache in place
  attention of q on the row's cache up to its new token       -> the layer's attention_fn (its backend)
  a = the attention's output projection                       -> the layer's `out`
  s' = s + a, z = gelu(LayerNorm2(s') @ fc + bias)            -> models.ops.norm_gemm.norm_gemm
  y' = z @ proj + bias                                         -> the block's `proj`
and returns (s', y'), the stream as the next block takes it. The cache advances as attnlayers.kv_cache.append
advances it for T = 1 (a row past the cache's end writes nothing, keeps its position, and its attention row is
NaN). Where one of `fusable`'s conditions fails, Block takes its general path, which runs the same Pallas
LayerNorm and bias + GELU kernels as separate ops.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from attnlayers import kv_cache
from models import ops
from models.ops import norm_gemm


def fusable(block, x: Float[Array, "B T D"], *, lengths, rngs) -> str:
  """The kernel the fused step runs on ("pallas" or "interpret"), or "" where `block` takes its general path:
  a step of more than one token, lengths=, dropout (rngs), normalised q/k, a cache with one shared position
  (Flax's layout), or what `_general` names."""
  attn = block.attn
  if x.shape[1] != 1 or lengths is not None or rngs is not None or attn.normalize_qk:
    return ""
  if attn.cache_index is None or attn.cache_index.ndim != 1:
    return ""
  kernel, why = ops.resolve(block.kernels, x)
  return "" if _general(kernel, why, fp8=block.fp8, head_dim=attn.head_dim) else kernel


def planned(cfg) -> str:
  """What a decode step of one token per row runs under `cfg` on the current device: "fused (pallas)" (or
  "fused (interpret)"), or "general: " and why; `fusable`'s answer for a decode call without lengths= or
  dropout, as models.generate.Decoder makes them."""
  kernel, why = ops.resolve(cfg.kernels)
  reason = _general(kernel, why, fp8=cfg.backend == "te-fp8", head_dim=cfg.d_model // cfg.n_head)
  return f"general: {reason}" if reason else f"fused ({kernel})"


def _general(kernel: str, why: str, *, fp8: bool, head_dim: int) -> str:
  """Why a model's decode step takes the general path ("" where it can fuse): kernels that resolve to XLA's
  fusions, FP8 projections (te-fp8), or heads norm_qkv cannot write."""
  if kernel not in ("pallas", "interpret"):
    return f"the model's kernels are {kernel}, {why}"
  if fp8:
    return "te-fp8 runs the projections as FP8 GEMMs"
  return norm_gemm.fits(head_dim)


def step(block, x: Float[Array, "B 1 D"], y: Float[Array, "B 1 D"] | None, kernel: str):
  """(s', y') of `block` for one token per row (module docstring), its cache written and advanced."""
  attn = block.attn
  B, _, D = x.shape
  dt, interpret = x.dtype, kernel == "interpret"
  rows = lambda a: None if a is None else a.reshape(B, D)
  projs = (attn.query, attn.key, attn.value)
  weights = tuple(p.kernel[...].astype(dt).reshape(D, -1) for p in projs)  # (D, N H), (D, K H), (D, K H)
  biases = tuple(_bias(p, dt).reshape(-1) for p in projs)
  index = attn.cache_index[...]  # (B,) each row's position for its token
  kv_cache.check_room(index, jnp.ones_like(index), attn.cached_key.shape[1])  # known positions: as append checks
  s, q, k, v = norm_gemm.norm_qkv(rows(x), rows(y), *_norm(block.ln1, dt), weights, biases, attn.cached_key[...],
                                  attn.cached_value[...], index, eps=block.ln1.epsilon, interpret=interpret)
  ends = index + 1
  window = {} if attn.sliding_window is None else {"window": attn.sliding_window}
  o = attn.attention_fn(q.reshape(B, 1, attn.num_heads, attn.head_dim), k, v, dtype=attn.dtype,
                        precision=attn.precision, deterministic=True,
                        **kv_cache.cached_attention(jnp.ones_like(index), ends), **window)  # (B, 1, N, H)
  a = attn.out(o)  # (B, 1, D)
  fits = ends <= k.shape[1]
  attn.cached_key[...], attn.cached_value[...] = k, v
  attn.cache_index[...] = jnp.where(fits, ends, index).astype(index.dtype)
  fc = block.fc
  s, z = norm_gemm.norm_gemm(s, rows(a), *_norm(block.ln2, dt), fc.kernel[...].astype(dt), _bias(fc, dt),
                             eps=block.ln2.epsilon, gelu=True, interpret=interpret)  # (B, D), (B, 4D)
  return s.reshape(B, 1, D), block.proj(z).reshape(B, 1, D)


def _norm(ln, dtype) -> tuple:
  """The LayerNorm's (scale, shift) in the compute dtype; shift 0 without a bias."""
  scale = ln.scale[...].astype(dtype)
  return scale, jnp.zeros_like(scale) if ln.bias is None else ln.bias[...].astype(dtype)


def _bias(linear, dtype):
  """The layer's bias in the compute dtype; 0 of its output shape without one."""
  return jnp.zeros(linear.kernel.shape[1:], dtype) if linear.bias is None else linear.bias[...].astype(dtype)
