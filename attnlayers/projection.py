"""The q/k/v projections as 2-D GEMMs, so that XLA can put their biases in the GEMM.

Flax's LinearGeneral adds a q/k/v projection's (N, H) bias to the (*batch, T, N, H) product.
XLA's GEMM rewriter fuses a bias into cuBLASLt's epilogue only when it is a vector over the
GEMM's output columns, so that (N, H) bias stays a separate pass that reads and writes all of
q, k and v. `heads` computes the same projection as x (.., D) @ kernel (D, N * H) + bias (N * H,)
and then reshapes, from the same parameters. With the trainer's compiler options
(train.loop.STEP_COMPILER_OPTIONS) the bias then runs in the GEMM; without them the program is
the same as Flax's.
"""

from __future__ import annotations

import jax
from flax import nnx
from jaxtyping import Array, Float


def plain(linear: nnx.LinearGeneral) -> bool:
  """Whether `heads` may compute this projection itself: one contracted axis, the last, no batch
  axes, and jax's own dot_general (a custom dot_general, e.g. an FP8 GEMM, runs as the layer's)."""
  return (tuple(linear.axis) == (-1,) and not linear.batch_axis and linear.dot_general is None
          and linear.dot_general_cls is None and linear.preferred_element_type is None)


def heads(linear: nnx.LinearGeneral, x: Float[Array, "*batch T D"], out_sharding=None) -> Float[Array, "*batch T N H"]:
  """linear(x) for x (*batch, T, D) and a LinearGeneral D -> (N, H): (*batch, T, N, H).

  The same parameters and promotion as the layer's own call, written as one 2-D GEMM plus a
  vector bias. Projections `plain` refuses, and calls with an out_sharding (a sharding of the
  4-D result), run as the layer's own call."""
  if out_sharding is not None or not plain(linear):
    return linear(x, out_sharding=out_sharding)
  kernel = linear.kernel[...].reshape(linear.kernel.shape[0], -1)  # (D, N * H)
  bias = None if linear.bias is None else linear.bias[...].reshape(-1)  # (N * H,)
  x, kernel, bias = linear.promote_dtype((x, kernel, bias), dtype=linear.dtype)
  y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=linear.precision)
  y = y if bias is None else y + bias  # (*batch, T, N * H)
  return y.reshape(*y.shape[:-1], *linear.out_features)  # (*batch, T, N, H)
