"""What the models' Pallas (Triton) kernels share: block widths, program counts, masked loads.

Letters: N rows, D features (the last axis).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


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
