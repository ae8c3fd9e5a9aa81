"""The q/k/v projections as 2-D GEMMs, so that XLA can put their biases in the GEMM.

Flax's LinearGeneral adds a q/k/v projection's (N, H) bias to the (*batch, T, N, H) product.
XLA's GEMM rewriter fuses a bias into cuBLASLt's epilogue only when it is a vector over the
GEMM's output columns, so that (N, H) bias stays a separate pass that reads and writes all of
q, k and v. `heads` computes the same projection as x (.., D) @ kernel (D, N * H) + bias (N * H,)
and then reshapes, from the same parameters. Compiled on a GPU with Triton GEMM fusions off
(compiler_options={"xla_gpu_enable_triton_gemm": False}, as the project's trainer compiles), the
bias then runs in the GEMM, added to its float32 result before the rounding to the compute dtype.
"""

from __future__ import annotations

import jax
from flax import nnx
from jaxtyping import Array, Float


def dense(x: Float[Array, "*batch D"], kernel: Float[Array, "D F"], bias: Float[Array, "F"] | None = None, *,
          dot_general=jax.lax.dot_general, precision=None, **kwargs) -> Float[Array, "*batch F"]:
  """x @ kernel (+ bias) over x's last axis, arguments already promoted: the q/k/v projections (`heads`, and
  te-fp8's fused q/k/v) and the model's first MLP GEMM (models.gpt). dot_general: jax's, or a module's own
  (an FP8 GEMM under te-fp8); kwargs go to it (e.g. preferred_element_type)."""
  y = dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision, **kwargs)  # (*batch, F)
  return y if bias is None else y + bias


def plain(linear: nnx.LinearGeneral) -> bool:
  """Whether `heads` may compute this projection itself: Flax's own LinearGeneral class (a subclass
  may compute something else), one contracted axis, the last, no batch axes, jax's own dot_general
  (a custom one, e.g. an FP8 GEMM, runs as the layer's) and no output dtype of its own."""
  return (type(linear) is nnx.LinearGeneral and tuple(linear.axis) == (-1,) and not linear.batch_axis
          and linear.dot_general is None and linear.dot_general_cls is None
          and linear.preferred_element_type is None)


def _sharded(a: jax.Array) -> bool:
  """Whether `a` is laid out over devices along some axis (replicated is not): under explicit mesh
  axes jax refuses the reshape of such a kernel, so it runs as the layer's own call."""
  spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", None)
  return spec is not None and any(s is not None for s in spec)


def heads(linear: nnx.LinearGeneral, x: Float[Array, "*batch T D"], out_sharding=None) -> Float[Array, "*batch T N H"]:
  """linear(x) for x (*batch, T, D) and a LinearGeneral D -> (N, H): (*batch, T, N, H).

  The same parameters and promotion (the layer's promote_dtype sees the parameters' own shapes)
  as the layer's call, written as one 2-D GEMM plus a vector bias. Projections `plain` refuses,
  kernels split over devices, and calls with an out_sharding (a sharding of the 4-D result) run
  as the layer's own call."""
  if out_sharding is not None or not plain(linear) or _sharded(linear.kernel[...]):
    return linear(x, out_sharding=out_sharding)
  bias = None if linear.bias is None else linear.bias[...]
  x, kernel, bias = linear.promote_dtype((x, linear.kernel[...], bias), dtype=linear.dtype)
  y = dense(x, kernel.reshape(kernel.shape[0], -1), None if bias is None else bias.reshape(-1),
            precision=linear.precision)  # (*batch, T, D) @ (D, N * H) + (N * H,)
  return y.reshape(*y.shape[:-1], *linear.out_features)  # (*batch, T, N, H)
