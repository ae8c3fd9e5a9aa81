"""A decode step's residual add, LayerNorm and the GEMM after it as one GPU kernel (Pallas, Triton).

Letters: M rows (a decode step's sequences), D features, F output features, B cache rows (B = M),
L cache positions, K key/value heads, H head dim.

s = x + y (rounded to x's dtype: the residual stream) and h = LayerNorm(s) (rounded to x's dtype), both as
models.ops.norm_fwd computes them; then out = h @ w + b with a float32 accumulator and bias, gelu
(models.ops.gelu) where asked, rounded once to x's dtype. In float32 the GEMM runs at full float32 precision
(IEEE products, not TF32), whatever jax's default matmul precision says. `norm_qkv` does this for the attention's three
projections at once and writes each row's new key and value into the KV cache at the row's position, in
place (the cache buffers are the kernel's outputs too), instead of handing them back.

Why: a decode step reads every weight for a few rows of activations, so each GEMM is a short kernel and the
step is bound by how many kernels it launches (benchmarks.kernels counts them). Unfused, the add and
LayerNorm, each GEMM, its bias, the GELU and each cache write are kernels of their own. Here each program
computes its rows' statistics (a few rows of D features) and walks D in chunks of BK, normalising each chunk
on the way into the GEMM, for BN output features. Forward only: decoding takes no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from models.ops import gelu as gelu_op
from models.ops import tiling
from models.ops.tiling import plgpu

BM = 16  # rows per program: the least a Triton dot takes; a decode step's rows are few
BK = 64  # features of D per step of a program's GEMM loop
WARPS, STAGES = 4, 3  # Triton warps per program, and pipeline stages of the GEMM loop's loads


def block_n(M: int, F: int, head_dim: int | None = None) -> int:
  """Output features per program: 32 for a step of at most BM rows (more programs to read the weights), else
  64; at most F rounded up to a power of two, at least 16; dividing head_dim where one is given (norm_qkv's
  programs each write within one head)."""
  n = max(16, min(32 if M <= BM else 64, tiling.lanes(F)))
  while head_dim is not None and head_dim % n:
    n //= 2
  return n


def fits(head_dim: int) -> str:
  """Why norm_qkv cannot take heads of `head_dim` features ("" where it can): its programs write whole blocks
  of at least 16 features within a head."""
  return "" if head_dim % 16 == 0 else f"head_dim {head_dim} is not a multiple of 16"


def norm_gemm(x: Float[Array, "M D"], y: Float[Array, "M D"] | None, scale: Float[Array, "D"], shift: Float[Array, "D"],
              w: Float[Array, "D F"], b: Float[Array, "F"], *, eps: float, gelu: bool = False,
              interpret: bool = False) -> tuple[Float[Array, "M D"], Float[Array, "M F"]]:
  """(s = x + y, act(LayerNorm(s) @ w + b)) in x's dtype; act is gelu where `gelu`, else none.

  Args:
    x, y: the residual stream and the branch output added to it, (M, D) in the compute dtype; y None: s = x.
    scale, shift: the LayerNorm's scale and bias (D,), in the compute dtype.
    w, b: the GEMM's weights (D, F) and bias (F,), in the compute dtype.
    eps: the LayerNorm's epsilon.
    gelu: apply models.ops.gelu's GELU after the bias.
    interpret: run the kernel in the Pallas interpreter (any backend; for tests).
  """
  M, D = _check(x, y, scale, shift)
  F = w.shape[1]
  if w.shape != (D, F) or b.shape != (F,):
    raise ValueError(f"norm_gemm wants w (D, F) = ({D}, F) and b (F,); got {tuple(w.shape)}, {tuple(b.shape)}")
  bn = block_n(M, F)
  tiles = pl.cdiv(F, bn)
  s, out = pl.pallas_call(
      functools.partial(_gemm_kernel, D=D, bn=bn, eps=float(eps), gelu=gelu, add=y is not None),
      grid=(tiles, pl.cdiv(M, BM)),
      out_shape=[jax.ShapeDtypeStruct((M, D), x.dtype), jax.ShapeDtypeStruct((M, F), x.dtype)],
      compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=STAGES),
      interpret=interpret,
  )(*_pair(x, y), scale, shift, w, b)
  return s, out


def norm_qkv(x: Float[Array, "M D"], y: Float[Array, "M D"] | None, scale: Float[Array, "D"], shift: Float[Array, "D"],
             weights: tuple, biases: tuple, cached_key: Float[Array, "B L K H"], cached_value: Float[Array, "B L K H"],
             index: Int[Array, "B"], *, eps: float, interpret: bool = False):
  """(s = x + y, the queries LayerNorm(s) @ wq + bq (M, N H), the cache's keys and values with row m's new ones at
  position index[m]), in x's dtype; a row whose position is not in [0, L) writes nothing.

  Args:
    x, y, scale, shift, eps, interpret: as norm_gemm takes them.
    weights: (wq (D, N H), wk (D, K H), wv (D, K H)): the three projections, heads flattened into features.
    biases: (bq (N H,), bk (K H,), bv (K H,)).
    cached_key, cached_value: the KV cache (B, L, K, H), B = M; the kernel writes into their buffers.
    index: each row's position for its new key and value, int32 (B,).
  """
  M, D = _check(x, y, scale, shift)
  B, L, K, H = cached_key.shape
  widths = [w.shape[1] for w in weights]
  if cached_value.shape != cached_key.shape or B != M or index.shape != (M,) or widths[1:] != [K * H, K * H] or \
      any(w.shape[0] != D for w in weights) or [b.shape for b in biases] != [(n,) for n in widths]:
    raise ValueError(f"norm_qkv wants caches (B, L, K, H) with B = M = {M}, index ({M},), weights (D, N H), "
                     f"(D, K H), (D, K H) with D = {D} and biases to match; got caches {tuple(cached_key.shape)}, "
                     f"{tuple(cached_value.shape)}, index {tuple(index.shape)}, weights "
                     f"{[tuple(w.shape) for w in weights]}, biases {[tuple(b.shape) for b in biases]}")
  if why := fits(H):
    raise ValueError(f"norm_qkv cannot write these heads: {why}")
  bn = block_n(M, max(widths), H)
  inputs = (*_pair(x, y), scale, shift, *weights, *biases, index.astype(jnp.int32), cached_key, cached_value)
  first = len(inputs) - 2  # the caches' place among the inputs: the last two
  tiles = tuple(pl.cdiv(n, bn) for n in widths)  # programs along each projection's features
  s, q, k, v = pl.pallas_call(
      functools.partial(_qkv_kernel, D=D, bn=bn, eps=float(eps), tiles=tiles, H=H, add=y is not None),
      grid=(sum(tiles), pl.cdiv(M, BM)),
      out_shape=[jax.ShapeDtypeStruct((M, D), x.dtype), jax.ShapeDtypeStruct((M, widths[0]), x.dtype),
                 jax.ShapeDtypeStruct(cached_key.shape, cached_key.dtype),
                 jax.ShapeDtypeStruct(cached_value.shape, cached_value.dtype)],
      input_output_aliases={first: 2, first + 1: 3},  # the caches are written in place
      compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=STAGES),
      interpret=interpret,
  )(*inputs)
  return s, q, k, v


def _pair(x, y) -> tuple:
  return (x,) if y is None else (x, y)


def _check(x, y, scale, shift) -> tuple[int, int]:
  M, D = x.shape
  if (y is not None and (y.shape != (M, D) or y.dtype != x.dtype)) or scale.shape != (D,) or shift.shape != (D,):
    raise ValueError(f"norm_gemm and norm_qkv want x and y (M, D) = ({M}, {D}) of one dtype, scale and shift "
                     f"({D},); got y {None if y is None else (tuple(y.shape), y.dtype)}, {tuple(scale.shape)}, {tuple(shift.shape)}")
  return M, D


def _stats(x_ref, y_ref, s_ref, r0, *, D: int, eps: float, write):
  """Rows r0 + [0, BM): their mean and rstd, float32 (BM,), summed over D in chunks of BK (a few rows' registers
  whatever D); s = x + y written where `write` (one program of the row block writes it)."""

  def step(k, sums):
    k0 = k * BK
    s, inside = tiling.load(x_ref, r0, k0, BM, BK)
    if y_ref is not None:
      s = s + tiling.load(y_ref, r0, k0, BM, BK)[0]
    s = s.astype(s_ref.dtype)  # the stream, rounded to its dtype
    plgpu.store(s_ref.at[pl.ds(r0, BM), pl.ds(k0, BK)], s, mask=inside & write)
    s = s.astype(jnp.float32)
    return sums[0] + jnp.sum(s, axis=1), sums[1] + jnp.sum(s * s, axis=1)

  zero = jnp.zeros((BM,), jnp.float32)
  total, squares = jax.lax.fori_loop(0, pl.cdiv(D, BK), step, (zero, zero))
  mean = total / D
  var = jnp.maximum(squares / D - mean * mean, 0.0)
  return mean, jax.lax.rsqrt(var + eps)


def _gemm(x_ref, y_ref, scale_ref, shift_ref, w_ref, b_ref, r0, c0, mean, rstd, *, D: int, bn: int):
  """(BM, bn) float32: LayerNorm(x + y) @ w + b at rows r0 + [0, BM), features c0 + [0, bn); 0 past F."""
  F = w_ref.shape[1]
  cols = (c0 + jnp.arange(bn)) < F  # (bn,)
  dtype = x_ref.dtype

  def step(k, acc):
    k0 = k * BK
    s, _ = tiling.load(x_ref, r0, k0, BM, BK)
    if y_ref is not None:
      s = s + tiling.load(y_ref, r0, k0, BM, BK)[0]
    s = s.astype(dtype).astype(jnp.float32)  # (BM, BK)
    inside = (k0 + jnp.arange(BK)) < D  # (BK,)
    vector = lambda ref: plgpu.load(ref.at[pl.ds(k0, BK)], mask=inside, other=0.0).astype(jnp.float32)
    h = ((s - mean[:, None]) * (rstd[:, None] * vector(scale_ref)[None, :]) + vector(shift_ref)[None, :])
    w = plgpu.load(w_ref.at[pl.ds(k0, BK), pl.ds(c0, bn)], mask=inside[:, None] & cols[None, :], other=0.0)
    # h past D is the shift's 0 (scale and shift load as 0 there), and w's rows there are 0 too
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return acc + plgpu.dot(h.astype(dtype), w.astype(dtype), precision=precision)

  acc = jax.lax.fori_loop(0, pl.cdiv(D, BK), step, jnp.zeros((BM, bn), jnp.float32))
  return acc + plgpu.load(b_ref.at[pl.ds(c0, bn)], mask=cols, other=0.0).astype(jnp.float32)[None, :]


def _gemm_kernel(*refs, D: int, bn: int, eps: float, gelu: bool, add: bool):
  """Program (j, i): features j * bn + [0, bn) of rows i * BM + [0, BM); programs j = 0 write s. refs: x, y
  (where add), scale, shift, w, b; s, out."""
  x_ref, y_ref, scale_ref, shift_ref, w_ref, b_ref, s_ref, o_ref = refs if add else (refs[0], None, *refs[1:])
  j, r0 = pl.program_id(0), pl.program_id(1) * BM
  mean, rstd = _stats(x_ref, y_ref, s_ref, r0, D=D, eps=eps, write=j == 0)
  out = _gemm(x_ref, y_ref, scale_ref, shift_ref, w_ref, b_ref, r0, j * bn, mean, rstd, D=D, bn=bn)
  if gelu:
    out = gelu_op.value(out)
  M, F = o_ref.shape
  mask = ((r0 + jnp.arange(BM)) < M)[:, None] & ((j * bn + jnp.arange(bn)) < F)[None, :]
  plgpu.store(o_ref.at[pl.ds(r0, BM), pl.ds(j * bn, bn)], out.astype(o_ref.dtype), mask=mask)


def _qkv_kernel(*refs, D: int, bn: int, eps: float, tiles: tuple, H: int, add: bool):
  """Program (j, i), rows i * BM + [0, BM): j < tiles[0] computes query features j * bn + [0, bn); the next
  tiles[1] programs the keys' features and the last tiles[2] the values', each written into its cache
  at the rows' positions. Programs j = 0 write s. refs: x, y (where add), scale, shift, the three weights and
  biases, index, the caches in; s, q, the caches out (the same buffers)."""
  (x_ref, y_ref, scale_ref, shift_ref, wq_ref, wk_ref, wv_ref, bq_ref, bk_ref, bv_ref, index_ref, _, _, s_ref, q_ref,
   k_ref, v_ref) = refs if add else (refs[0], None, *refs[1:])
  j, r0 = pl.program_id(0), pl.program_id(1) * BM
  M = x_ref.shape[0]
  rows = r0 + jnp.arange(BM)  # (BM,)
  real = rows < M
  mean, rstd = _stats(x_ref, y_ref, s_ref, r0, D=D, eps=eps, write=j == 0)
  gemm = functools.partial(_gemm, x_ref, y_ref, scale_ref, shift_ref, r0=r0, mean=mean, rstd=rstd, D=D, bn=bn)

  @pl.when(j < tiles[0])
  def _query():
    c0 = j * bn
    out = gemm(wq_ref, bq_ref, c0=c0)
    mask = real[:, None] & ((c0 + jnp.arange(bn)) < q_ref.shape[1])[None, :]
    plgpu.store(q_ref.at[pl.ds(r0, BM), pl.ds(c0, bn)], out.astype(q_ref.dtype), mask=mask)

  L = k_ref.shape[1]
  row = jnp.minimum(rows, M - 1)  # in range for the indexer; `real` masks the rest
  pos = plgpu.load(index_ref.at[pl.ds(r0, BM)], mask=real, other=0)  # (BM,)
  write = real & (pos >= 0) & (pos < L)  # a row past the cache writes nothing
  pos = jnp.clip(pos, 0, L - 1)

  for part, (w_ref, b_ref, cache_ref) in enumerate(((wk_ref, bk_ref, k_ref), (wv_ref, bv_ref, v_ref)), start=1):
    first = sum(tiles[:part])

    @pl.when((j >= first) & (j < first + tiles[part]))
    def _cache(w_ref=w_ref, b_ref=b_ref, cache_ref=cache_ref, first=first):
      c0 = (j - first) * bn  # within one head: bn divides H
      out = gemm(w_ref, b_ref, c0=c0)
      head, d0 = c0 // H, c0 % H
      feature = d0 + jnp.arange(bn)[None, :]  # (1, bn); every index an array, as the interpreter takes them
      value = out.astype(x_ref.dtype).astype(cache_ref.dtype)  # rounded to the compute dtype, as projected
      plgpu.store(cache_ref.at[row[:, None], pos[:, None], head, feature], value,
                  mask=write[:, None] & (feature < H))
