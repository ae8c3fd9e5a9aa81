"""The q/k/v projections as 2-D GEMMs, so that XLA can put their biases in the GEMM.

Flax's LinearGeneral adds a q/k/v projection's (N, H) bias to the (*batch, T, N, H) product.
XLA's GEMM rewriter fuses a bias into cuBLASLt's epilogue only when it is a vector over the
GEMM's output columns, so that (N, H) bias stays a separate pass that reads and writes all of
q, k and v. `heads` computes the same projection as x (.., D) @ kernel (D, N * H) + bias (N * H,)
and then reshapes, from the same parameters. Compiled with the trainer's options
(train.loop.STEP_COMPILER_OPTIONS) on a GPU, the bias then runs in the GEMM, added to its float32
result before the rounding to the compute dtype.

Self-attention projects one input three times, so the input's gradient is the sum of three
GEMMs. Differentiated as three separate projections, jax sums them as (v's + k's) + q's, and
XLA folds only the first add into a GEMM (cuBLAS's C operand, beta = 1); the second is a pass
of its own over (*batch, T, D). `self_heads` computes the same q, k and v with a backward that
writes the sum as a chain, each GEMM adding the sum so far (q's, then k's GEMM + it, then v's
GEMM + that), which XLA runs as three GEMMs and no other pass. On the H200, for gpt2-small's
(32768, 768) inputs, the three GEMMs and their sum took 0.3539 ms chained against 0.4411 ms
as jax sums them (each timed alone, 50 calls).
"""

from __future__ import annotations

import functools

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


def self_heads(projs: tuple[nnx.LinearGeneral, ...], x: Float[Array, "*batch T D"], out_sharding=None
               ) -> tuple[Float[Array, "*batch T _ H"], ...]:
  """tuple(heads(linear, x) for linear in projs): self-attention's q, k and v of one input x, the input's
  gradient summed as a chain of GEMMs (module docstring). Projections `heads` would not compute itself,
  or that promote x to different dtypes or take different precisions, run one by one through `heads`."""
  if (out_sharding is not None or not all(plain(p) and not _sharded(p.kernel[...]) for p in projs)
      or len({p.precision for p in projs}) > 1):
    return tuple(heads(p, x, out_sharding) for p in projs)
  promoted = [p.promote_dtype((x, p.kernel[...], None if p.bias is None else p.bias[...]), dtype=p.dtype)
              for p in projs]  # each (x, kernel (D, n, H), bias (n, H) | None) in its compute dtype
  if len({xp.dtype for xp, _, _ in promoted}) > 1:
    return tuple(heads(p, x, out_sharding) for p in projs)
  kernels = tuple(k.reshape(k.shape[0], -1) for _, k, _ in promoted)  # each (D, n * H)
  ys = _chained(promoted[0][0], kernels, projs[0].precision)  # each (*batch, T, n * H)
  out = []
  for p, (_, _, b), y in zip(projs, promoted, ys):
    y = y if b is None else y + b.reshape(-1)  # (*batch, T, n * H) + (n * H,): in the GEMM's epilogue
    out.append(y.reshape(*y.shape[:-1], *p.out_features))  # (*batch, T, n, H)
  return tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _chained(x, kernels, precision):
  """x (*batch, D) @ each kernel (D, F_i): a tuple of (*batch, F_i)."""
  return tuple(dense(x, k, precision=precision) for k in kernels)


def _chained_fwd(x, kernels, precision):
  return _chained(x, kernels, precision), (x, kernels)


def _chained_bwd(precision, residuals, cts):
  x, kernels = residuals
  lead = tuple(range(x.ndim - 1))  # the (*batch, T) axes, contracted for the kernels' gradients
  dx, dks = None, []
  for k, ct in zip(kernels, cts):  # ct (*batch, T, F)
    part = jax.lax.dot_general(ct, k, (((ct.ndim - 1,), (1,)), ((), ())), precision=precision)  # (*batch, T, D)
    dx = part if dx is None else part + dx  # the GEMM first: XLA folds the add into it
    dks.append(jax.lax.dot_general(x, ct, ((lead, lead), ((), ())), precision=precision))  # (D, F)
  return dx, tuple(dks)


_chained.defvjp(_chained_fwd, _chained_bwd)
