"""What the models' Pallas (Triton) kernels share: block widths, program counts, masked loads.

Letters: N rows, D features (the last axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import triton as plgpu  # the kernels' loads, stores and compiler settings
except ImportError:  # a jax without Pallas's Triton backend: models.ops.resolve never runs the kernels there
  plgpu = None


def lanes(d: int) -> int:
  """d rounded up to a power of two, as Triton's block shapes must be; a kernel masks the rest."""
  return 1 << (d - 1).bit_length()


def programs(tiles: int, most: int) -> tuple[int, int]:
  """(P, tiles per program) to walk `tiles` tiles with at most `most` programs, each a contiguous run and none
  left without a tile."""
  per = pl.cdiv(tiles, min(most, tiles))
  return pl.cdiv(tiles, per), per


def load(ref, r0, c0, rows: int, width: int):
  """(the (rows, width) block of the 2-D ref at (r0, c0) in float32, 0 outside the ref; the mask of what lies
  inside)."""
  N, D = ref.shape
  mask = ((r0 + jnp.arange(rows)) < N)[:, None] & ((c0 + jnp.arange(width)) < D)[None, :]
  block = plgpu.load(ref.at[pl.ds(r0, rows), pl.ds(c0, width)], mask=mask, other=0.0)
  return block.astype(jnp.float32), mask


def row_block(ref, j, lane):
  """Logits j * B + lane of the 1-D ref (a row of V; lane = arange(B), made once outside the sweep's loop) in
  float32, -inf past V; their indices; the mask of what lies inside. A row kernel reads its row through this."""
  (V,) = ref.shape
  block = lane.shape[0]
  idx = j * block + lane  # (B,)
  valid = idx < V
  x = plgpu.load(ref.at[pl.ds(j * block, block)], mask=valid, other=-jnp.inf)
  return x.astype(jnp.float32), idx, valid


def row_call(kernel, logits, targets, real, out_dtype, per_row: int, *, warps: int, interpret: bool):
  """The loss's row kernels over a (C, V) chunk of logits: one program per row, given its logits, target and
  real (1: a token, 0: padding), writing a (C, V) block in out_dtype and `per_row` (C,) float32 values, the last
  the loss. That loss comes back NaN for a target outside [0, V) (the kernel would read another logit) and 0
  for padding, even where its row is not finite."""
  C, V = logits.shape
  if targets.shape != (C,) or real.shape != (C,):
    raise ValueError(f"targets and real must be (C,) = ({C},); got {tuple(targets.shape)}, {tuple(real.shape)}")
  row = lambda i: (i, 0)
  one = lambda i: (i,)
  *outs, nll = pl.pallas_call(
      kernel,
      grid=(C,),
      in_specs=[pl.BlockSpec((None, V), row), pl.BlockSpec((1,), one), pl.BlockSpec((1,), one)],
      out_specs=[pl.BlockSpec((None, V), row)] + [pl.BlockSpec((1,), one)] * per_row,
      out_shape=[jax.ShapeDtypeStruct((C, V), jnp.dtype(out_dtype))] + [jax.ShapeDtypeStruct((C,), jnp.float32)]
      * per_row,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      interpret=interpret,
  )(logits, targets.astype(jnp.int32), real.astype(jnp.float32))
  nll = jnp.where((targets < 0) | (targets >= V), jnp.nan, nll)  # (C,)
  return (*outs, jnp.where(real > 0, nll, 0.0))
