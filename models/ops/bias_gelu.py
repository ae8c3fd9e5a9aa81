"""The MLP's bias add and GELU as one op, gelu(z + b), on the first GEMM's output z.

Letters: N rows (tokens), F features (the MLP's hidden width), P programs.

Why: the bias add and GELU are passes over the (N, F) hidden activation, the step's largest after
the logits. As one op, the forward reads z once and writes gelu(z + b); the backward keeps z and
b (as a plain GELU keeps its input) and recomputes z + b, so nothing else of size (N, F) is
saved. On a GPU both directions are Pallas (Triton) kernels: the forward computes the float32
exp and division in one pass, and the backward writes dz once while each program keeps its rows'
bias-gradient sums in registers. Elsewhere, or with kernel="xla", the same float32 formula runs as
XLA fusions (models.ops.resolve picks).

Numerics: z + b is formed in float32 (not rounded to z's dtype first), gelu and its derivative
are models.ops.gelu's, each output is rounded once to its dtype; db is a float32 sum over rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from models import ops
from models.ops import gelu, tiling
from models.ops.tiling import plgpu

FWD_TILE = (8, 1024)  # rows x features per forward program (powers of two; the rest masked)
BWD_TILE = (4, 1024)  # rows x features per backward step; each program walks a contiguous run of row tiles
BWD_PROGRAMS = 256  # at most, along the rows; each writes one (F,) partial of db per feature block
WARPS = 4  # Triton warps per program
# The tiles, program count and warps are the fastest of those tried on an H200 at gpt2-small's MLP width.


def bias_gelu(z: Float[Array, "... F"], b: Float[Array, "F"], *, kernel: str = "auto") -> Float[Array, "... F"]:
  """gelu(z + b) (models.ops.gelu's tanh approximation) in z's dtype; differentiable in z and b (reverse mode).

  Args:
    z: the first MLP GEMM's output without its bias.
    b: that bias in the compute dtype (as flax promotes it, e.g. `fc.bias[...].astype(z.dtype)`).
    kernel: one of models.ops.KERNELS; "auto" (the default) as models.ops.resolve picks.
  """
  if b.ndim != 1 or z.ndim < 1 or z.shape[-1] != b.shape[0]:
    raise ValueError(f"bias_gelu wants z (..., F) and b (F,) with the same F; got z {tuple(z.shape)}, b "
                     f"{tuple(b.shape)}")
  if not (jnp.issubdtype(z.dtype, jnp.floating) and jnp.issubdtype(b.dtype, jnp.floating)):
    raise ValueError(f"bias_gelu takes floating-point z and b; got {z.dtype} and {b.dtype}")
  if z.size == 0:
    raise ValueError(f"bias_gelu wants at least one row and one feature; got z {tuple(z.shape)}")
  kernel, _ = ops.resolve(kernel, z)
  return _bias_gelu(z, b, kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bias_gelu(z, b, kernel):
  if kernel == "xla":
    return gelu.value(z.astype(jnp.float32) + b.astype(jnp.float32)).astype(z.dtype)
  y = _forward(z.reshape(-1, z.shape[-1]), b, interpret=kernel == "interpret")
  return y.reshape(z.shape)


def _bias_gelu_fwd(z, b, kernel):
  return _bias_gelu(z, b, kernel), (z, b)


def _bias_gelu_bwd(kernel, residuals, dy):
  z, b = residuals
  if kernel == "xla":
    g = dy.astype(jnp.float32) * gelu.derivative(z.astype(jnp.float32) + b.astype(jnp.float32))
    return g.astype(z.dtype), g.sum(tuple(range(z.ndim - 1))).astype(b.dtype)
  flat = lambda a: a.reshape(-1, a.shape[-1])
  dz, db = _backward(flat(z), b, flat(dy), interpret=kernel == "interpret")
  return dz.reshape(z.shape), db.astype(b.dtype)


_bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


def gelu_of_gemm(z: Float[Array, "... F"], *, kernel: str = "auto") -> Float[Array, "... F"]:
  """gelu(z) in z's dtype for z the output of a plain XLA GEMM with no bias (an MLP without biases);
  differentiable in z (reverse mode).

  With the Pallas kernels ("pallas", "interpret") the forward is jax.nn.gelu's tanh form on z, the pattern
  XLA's GEMM rewriter puts in the GEMM's cuBLASLt epilogue on a GPU ("GELU_AUX": the GEMM writes gelu(z)
  and z, which the backward keeps, and no pass of its own reads z); the backward is bias_gelu's Pallas
  kernel with a zero bias. Behind any other producer (a TE FP8 GEMM) nothing fuses, and XLA's pass costs
  more than bias_gelu's kernel: use bias_gelu there. With "xla" this is bias_gelu with a zero bias.
  Numerics: in the epilogue GELU is taken of the float32 accumulator and rounded once; elsewhere of z, in
  XLA's float32 fusion of the bfloat16 formula.

  Args:
    z: a bias-free GEMM's output.
    kernel: one of models.ops.KERNELS; "auto" (the default) as models.ops.resolve picks.
  """
  if not jnp.issubdtype(z.dtype, jnp.floating) or z.size == 0:
    raise ValueError(f"gelu_of_gemm takes a non-empty floating-point z; got {z.dtype} {tuple(z.shape)}")
  kernel, _ = ops.resolve(kernel, z)
  return _gelu_of_gemm(z, kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gelu_of_gemm(z, kernel):
  if kernel == "xla":
    return _bias_gelu(z, jnp.zeros(z.shape[-1:], z.dtype), kernel)
  return jax.nn.gelu(z, approximate=True)  # (..., F): the rewriter's pattern, on the GEMM's output itself


def _gelu_of_gemm_fwd(z, kernel):
  return _gelu_of_gemm(z, kernel), z


def _gelu_of_gemm_bwd(kernel, z, dy):  # the kernel also forms float32 bias sums, (P, F), dropped here: small beside dz
  return (_bias_gelu_bwd(kernel, (z, jnp.zeros(z.shape[-1:], z.dtype)), dy)[0],)


_gelu_of_gemm.defvjp(_gelu_of_gemm_fwd, _gelu_of_gemm_bwd)


def _forward(z: Float[Array, "N F"], b: Float[Array, "F"], *, interpret: bool) -> Float[Array, "N F"]:
  N, F = z.shape
  rows, lanes = FWD_TILE
  return pl.pallas_call(
      functools.partial(_fwd_kernel, F=F, rows=rows, lanes=lanes),
      grid=(pl.cdiv(N, rows), pl.cdiv(F, lanes)),
      out_shape=jax.ShapeDtypeStruct((N, F), z.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1),
      interpret=interpret,
  )(z, b)


def _fwd_kernel(z_ref, b_ref, y_ref, *, F: int, rows: int, lanes: int):
  """Program (i, j): rows i * rows + [0, rows), features j * lanes + [0, lanes). z_ref, y_ref (N, F); b_ref (F,)."""
  r0, c0 = pl.program_id(0) * rows, pl.program_id(1) * lanes
  z, mask = tiling.load(z_ref, r0, c0, rows, lanes)
  b = plgpu.load(b_ref.at[pl.ds(c0, lanes)], mask=(c0 + jnp.arange(lanes)) < F, other=0.0).astype(jnp.float32)
  y = gelu.value(z + b[None, :])
  plgpu.store(y_ref.at[pl.ds(r0, rows), pl.ds(c0, lanes)], y.astype(y_ref.dtype), mask=mask)


def _backward(z: Float[Array, "N F"], b: Float[Array, "F"], dy: Float[Array, "N F"], *,
              interpret: bool) -> tuple[Float[Array, "N F"], Float[Array, "F"]]:
  """(dz in z's dtype, db float32)."""
  N, F = z.shape
  rows, lanes = BWD_TILE
  P, tiles = tiling.programs(pl.cdiv(N, rows), BWD_PROGRAMS)  # programs, row tiles each
  dz, part = pl.pallas_call(
      functools.partial(_bwd_kernel, F=F, rows=rows, lanes=lanes, tiles=tiles),
      grid=(P, pl.cdiv(F, lanes)),
      out_shape=[jax.ShapeDtypeStruct((N, F), z.dtype), jax.ShapeDtypeStruct((P, F), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1),
      interpret=interpret,
  )(z, b, dy)
  return dz, part.sum(0)  # (N, F), (F,)


def _bwd_kernel(z_ref, b_ref, dy_ref, dz_ref, db_ref, *, F: int, rows: int, lanes: int, tiles: int):
  """Program (p, j): row tiles p * tiles + [0, tiles) of features j * lanes + [0, lanes); writes dz there and
  its column sums into db_ref (P, F) row p."""
  p, c0 = pl.program_id(0), pl.program_id(1) * lanes
  col = (c0 + jnp.arange(lanes)) < F
  b = plgpu.load(b_ref.at[pl.ds(c0, lanes)], mask=col, other=0.0).astype(jnp.float32)

  def tile(i, db):
    r0 = (p * tiles + i) * rows
    z, mask = tiling.load(z_ref, r0, c0, rows, lanes)
    dy, _ = tiling.load(dy_ref, r0, c0, rows, lanes)
    g = dy * gelu.derivative(z + b[None, :])  # 0 where masked (dy is)
    plgpu.store(dz_ref.at[pl.ds(r0, rows), pl.ds(c0, lanes)], g.astype(dz_ref.dtype), mask=mask)
    return db + jnp.sum(g, axis=0)

  db = jax.lax.fori_loop(0, tiles, tile, jnp.zeros((lanes,), jnp.float32))
  plgpu.store(db_ref.at[p, pl.ds(c0, lanes)], db, mask=col)
