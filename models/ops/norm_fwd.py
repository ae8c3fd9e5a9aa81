"""The residual add and LayerNorm's forward in one GPU kernel (Pallas, Triton).

Letters: N rows (tokens), D features.

s = x + y (rounded to x's dtype: the residual stream), and with float32 statistics of s,
mean = E[s], rstd = 1 / sqrt(max(E[s^2] - mean^2, 0) + eps) (flax's fast variance),
h = (s - mean) * (rstd * scale) + bias, rounded once to x's dtype.

Why: XLA runs this as two fusions, the add with the row sums and the normalisation, so s is
written and then read back. Here each program holds whole rows in registers, reads x and y once
and writes s, h and the statistics the backward needs (models.ops.norm_grad).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from models.ops import tiling
from models.ops.tiling import plgpu

ROWS = 1  # rows per program: the fastest of 1 to 16 tried on an H200 at gpt2-small's width


def add_norm(x: Float[Array, "N D"], y: Float[Array, "N D"] | None, scale: Float[Array, "D"], bias: Float[Array, "D"],
             eps: float, *, interpret: bool = False) -> tuple[Float[Array, "N D"], Float[Array, "N D"],
                                                              Float[Array, "N"], Float[Array, "N"]]:
  """(s = x + y in x's dtype (x itself where y is None), h = LayerNorm(s) in x's dtype, mean, rstd float32 (N,))."""
  N, D = x.shape
  if (y is not None and y.shape != (N, D)) or scale.shape != (D,) or bias.shape != (D,):
    raise ValueError(f"add_norm wants x and y (N, D) = ({N}, {D}), scale and bias ({D},); got "
                     f"{None if y is None else tuple(y.shape)}, {tuple(scale.shape)}, {tuple(bias.shape)}")
  if N < 1 or D < 1:
    raise ValueError(f"add_norm wants at least one row and one feature; got (N, D) = ({N}, {D})")
  lanes = tiling.lanes(D)
  row = jax.ShapeDtypeStruct((N,), jnp.float32)
  rows = jax.ShapeDtypeStruct((N, D), x.dtype)
  add = y is not None
  out = pl.pallas_call(
      functools.partial(_kernel, N=N, D=D, lanes=lanes, eps=float(eps), add=add),
      grid=(pl.cdiv(N, ROWS),),
      out_shape=[rows, rows, row, row] if add else [rows, row, row],
      compiler_params=plgpu.CompilerParams(num_warps=min(32, max(4, lanes // 256)), num_stages=1),
      interpret=interpret,
  )(*((x, scale, bias, y) if add else (x, scale, bias)))
  return tuple(out) if add else (x, *out)


def _kernel(x_ref, scale_ref, bias_ref, *refs, N: int, D: int, lanes: int, eps: float, add: bool):
  """Program i: rows i * ROWS + [0, ROWS). x_ref, h_ref and, where add, y_ref and s_ref (N, D); scale_ref,
  bias_ref (D,); mean_ref, rstd_ref (N,)."""
  y_ref, s_ref, h_ref, mean_ref, rstd_ref = refs if add else (None, None, *refs)
  r0 = pl.program_id(0) * ROWS
  row = (r0 + jnp.arange(ROWS)) < N  # (ROWS,)
  col = jnp.arange(lanes) < D  # (lanes,)
  s, both = tiling.load(x_ref, r0, 0, ROWS, lanes)  # (ROWS, lanes) float32, 0 where masked
  if add:
    s = (s + tiling.load(y_ref, r0, 0, ROWS, lanes)[0]).astype(s_ref.dtype)  # the stream, rounded to its dtype
    plgpu.store(s_ref.at[pl.ds(r0, ROWS), pl.ds(0, lanes)], s, mask=both)
    s = s.astype(jnp.float32)
  mean = jnp.sum(s, axis=1) / D  # (ROWS,)
  var = jnp.maximum(jnp.sum(s * s, axis=1) / D - mean * mean, 0.0)
  rstd = jax.lax.rsqrt(var + eps)
  vector = lambda ref: plgpu.load(ref.at[pl.ds(0, lanes)], mask=col, other=0.0).astype(jnp.float32)
  h = (s - mean[:, None]) * (rstd[:, None] * vector(scale_ref)[None, :]) + vector(bias_ref)[None, :]
  plgpu.store(h_ref.at[pl.ds(r0, ROWS), pl.ds(0, lanes)], h.astype(h_ref.dtype), mask=both)
  plgpu.store(mean_ref.at[pl.ds(r0, ROWS)], mean, mask=row)
  plgpu.store(rstd_ref.at[pl.ds(r0, ROWS)], rstd, mask=row)
