"""LayerNorm's backward, the residual stream's gradient added, in one GPU kernel (Pallas, Triton).

Letters: N rows (tokens), D features, P programs.

Per row, with xhat = (x - mean) * rstd and g = dy * scale:
  dx = dres + rstd * (g - mean(g) - xhat * mean(g * xhat))
and over all rows dscale = sum(dy * xhat), dbias = sum(dy), in float32.

Why: XLA splits this into a fusion for the two row means and one for dx and the column sums, so
x and dy are read twice. Here each program walks its rows a tile at a time, holds whole rows in
registers (D up to a few thousand), writes dx once and keeps its dscale / dbias partial sums in
registers; the (P, D) partials are summed by XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from models.ops import tiling
from models.ops.tiling import plgpu

ROWS = 2  # rows per tile
PROGRAMS = 528  # at most; each writes one (D,) partial of dscale and of dbias
# ROWS and PROGRAMS are the fastest of those tried on an H200 at gpt2-small's width.


def norm_grad(x: Float[Array, "N D"], dy: Float[Array, "N D"], dres: Float[Array, "N D"], mean: Float[Array, "N"],
              rstd: Float[Array, "N"], scale: Float[Array, "D"], *,
              interpret: bool = False) -> tuple[Float[Array, "N D"], Float[Array, "D"], Float[Array, "D"]]:
  """(dx in x's dtype, dscale, dbias in float32) for y = (x - mean) * rstd * scale + bias, given dy = d/dy and
  dres, the gradient x gets elsewhere (the residual stream), added to dx. mean, rstd: the forward's, float32."""
  N, D = x.shape
  if dy.shape != (N, D) or dres.shape != (N, D) or mean.shape != (N,) or rstd.shape != (N,) or scale.shape != (D,):
    raise ValueError(f"norm_grad wants x, dy, dres (N, D) = ({N}, {D}), mean and rstd ({N},), scale ({D},); got "
                     f"{tuple(dy.shape)}, {tuple(dres.shape)}, {tuple(mean.shape)}, {tuple(rstd.shape)}, "
                     f"{tuple(scale.shape)}")
  if N < 1 or D < 1:
    raise ValueError(f"norm_grad wants at least one row and one feature; got (N, D) = ({N}, {D})")
  lanes = tiling.lanes(D)
  P, tiles = tiling.programs(pl.cdiv(N, ROWS), PROGRAMS)  # programs, row tiles each
  part = jax.ShapeDtypeStruct((P, D), jnp.float32)
  dx, dscale, dbias = pl.pallas_call(
      functools.partial(_kernel, N=N, D=D, lanes=lanes, tiles=tiles),
      grid=(P,),
      out_shape=[jax.ShapeDtypeStruct((N, D), x.dtype), part, part],
      compiler_params=plgpu.CompilerParams(num_warps=min(32, max(4, lanes // 256)), num_stages=1),
      interpret=interpret,
  )(x, dy, dres, mean.astype(jnp.float32), rstd.astype(jnp.float32), scale.astype(jnp.float32))
  return dx, dscale.sum(0), dbias.sum(0)  # (N, D), (D,), (D,)


def _kernel(x_ref, dy_ref, dres_ref, mean_ref, rstd_ref, scale_ref, dx_ref, dscale_ref, dbias_ref, *, N: int, D: int,
            lanes: int, tiles: int):
  """Program p: rows (p * tiles + i) * ROWS + [0, ROWS) for i < tiles; x_ref, dy_ref, dres_ref, dx_ref (N, D);
  mean_ref, rstd_ref (N,); scale_ref (D,); dscale_ref, dbias_ref (P, D), row p its partial sums."""
  p = pl.program_id(0)
  col = jnp.arange(lanes) < D  # (lanes,)
  scale = plgpu.load(scale_ref.at[pl.ds(0, lanes)], mask=col, other=0.0)  # (lanes,)

  def tile(i, sums):  # ROWS rows: dx written; their dy * xhat and dy added to the program's sums
    r0 = (p * tiles + i) * ROWS
    row = (r0 + jnp.arange(ROWS)) < N  # (ROWS,)
    (x, both), (dy, _), (dres, _) = (tiling.load(ref, r0, 0, ROWS, lanes) for ref in (x_ref, dy_ref, dres_ref))
    mean = plgpu.load(mean_ref.at[pl.ds(r0, ROWS)], mask=row, other=0.0)[:, None]  # (ROWS, 1)
    rstd = plgpu.load(rstd_ref.at[pl.ds(r0, ROWS)], mask=row, other=0.0)[:, None]  # (ROWS, 1)
    xhat = jnp.where(both, (x - mean) * rstd, 0.0)
    g = dy * scale[None, :]
    mean_g = jnp.sum(g, axis=1, keepdims=True) / D  # (ROWS, 1)
    mean_gx = jnp.sum(g * xhat, axis=1, keepdims=True) / D
    dx = dres + rstd * (g - mean_g - xhat * mean_gx)
    plgpu.store(dx_ref.at[pl.ds(r0, ROWS), pl.ds(0, lanes)], dx.astype(dx_ref.dtype), mask=both)
    dscale, dbias = sums
    return dscale + jnp.sum(dy * xhat, axis=0), dbias + jnp.sum(dy, axis=0)

  zero = jnp.zeros((lanes,), jnp.float32)
  dscale, dbias = jax.lax.fori_loop(0, tiles, tile, (zero, zero))
  plgpu.store(dscale_ref.at[p, pl.ds(0, lanes)], dscale, mask=col)
  plgpu.store(dbias_ref.at[p, pl.ds(0, lanes)], dbias, mask=col)
