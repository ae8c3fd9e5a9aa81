"""LayerNorm that also hands back its input, so that its backward adds the residual stream's gradient.

Letters: B batch, T sequence, D features.

`residual_norm(ln, x, y)` returns (s, ln(s)) with s = x + y (the residual stream, its branch's
output added; s = x where y is None) for an nnx.LayerNorm `ln`, with ln(s) computed by the same
formula as flax's (float32 statistics, variance E[s^2] - E[s]^2, scale and bias cast to the compute
dtype). A pre-norm block reads the residual stream twice, into the LayerNorm and past it; taking s
back from here routes the stream's gradient into this op's backward, which returns
dres + LayerNorm'(dy) in one pass (for x and y alike). On a GPU both directions are Pallas kernels:
the add, statistics and normalisation in one pass (models.ops.norm_fwd), the backward in another
(models.ops.norm_grad); elsewhere the same float32 formulas run as XLA fusions (models.ops.resolve picks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from models import ops
from models.ops import norm_fwd, norm_grad


def residual_norm(ln: nnx.LayerNorm, x: Float[Array, "B T D"], y: Float[Array, "B T D"] | None = None, *,
                  kernel: str = "auto") -> tuple[Float[Array, "B T D"], Float[Array, "B T D"]]:
  """(s, ln(s)) with s = x + y (x where y is None); differentiable in x, y and ln's scale and bias (reverse mode).

  A LayerNorm without bias (use_bias=False) runs the same kernels with a zero bias, whose gradient is dropped.

  Args:
    ln: the model's LayerNorm (over the last axis, with a scale and flax's fast variance).
    x: the residual stream, in the LayerNorm's compute dtype.
    y: the branch output added to it, x's shape and dtype; None: s = x.
    kernel: one of models.ops.KERNELS; "auto" (the default) as models.ops.resolve picks.
  """
  if ln.reduction_axes not in (-1, (-1,)) or ln.feature_axes not in (-1, (-1,)) or ln.scale is None or \
      not ln.use_fast_variance or ln.axis_name is not None:
    raise ValueError("residual_norm takes a LayerNorm over the last axis with a scale, fast variance and no "
                     "axis_name (the model's own); call the module itself for others")
  bias = jnp.zeros_like(ln.scale[...]) if ln.bias is None else ln.bias[...]  # (D,)
  dtype = ln.dtype or jnp.result_type(x, ln.scale[...], bias)
  if x.dtype != dtype:  # flax would compute in dtype; x handed back in it would change the residual stream's dtype
    raise ValueError(f"residual_norm hands the stream (x, or x + y) back in x's dtype, so x must already be in the "
                     f"LayerNorm's compute dtype {jnp.dtype(dtype).name}; got {x.dtype} (cast x first, or call the "
                     "module itself)")
  if y is not None and (y.shape != x.shape or y.dtype != x.dtype):
    raise ValueError(f"residual_norm adds y to x in x's dtype, so y must have x's shape and dtype {tuple(x.shape)} "
                     f"{x.dtype}; got {tuple(y.shape)} {y.dtype}")
  scale, bias = (jnp.asarray(v, dtype) for v in (ln.scale[...], bias))  # as flax promotes them
  kernel, _ = ops.resolve(kernel, x)
  return _residual_norm(x, y, scale, bias, float(ln.epsilon), kernel, y is None)


def _stats(x, eps: float):
  """Each row's float32 mean and 1 / sqrt(var + eps), var = E[x^2] - E[x]^2 clipped at 0 (flax's fast variance)."""
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1)
  var = jnp.maximum((xf * xf).mean(-1) - mean * mean, 0.0)
  return mean, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _residual_norm(x, y, scale, bias, eps, kernel, alone):  # alone: y is None
  return _residual_norm_fwd(x, y, scale, bias, eps, kernel, alone)[0]


def _residual_norm_fwd(x, y, scale, bias, eps, kernel, alone):
  if kernel in ("pallas", "interpret"):
    flat = lambda a: None if a is None else a.reshape(-1, a.shape[-1])
    s, h, mean, rstd = norm_fwd.add_norm(flat(x), flat(y), scale, bias, eps, interpret=kernel == "interpret")
    s, h, mean, rstd = s.reshape(x.shape), h.reshape(x.shape), mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])
  else:
    s = x if y is None else x + y  # the residual stream, in its dtype
    mean, rstd = _stats(s, eps)  # (B, T) each
    h = ((s - mean[..., None]) * (rstd[..., None] * scale) + bias).astype(x.dtype)  # flax's order of operations
  return (s, h), (s, mean, rstd, scale)


def _residual_norm_bwd(eps, kernel, alone, residuals, cotangents):
  x, mean, rstd, scale = residuals
  dres, dy = cotangents  # (B, T, D): the stream's gradient, and the normalised output's
  D = x.shape[-1]
  if kernel in ("pallas", "interpret"):
    flat = lambda a: a.reshape(-1, a.shape[-1]) if a.ndim == x.ndim else a.reshape(-1)
    dx, dscale, dbias = norm_grad.norm_grad(flat(x), flat(dy), flat(dres), flat(mean), flat(rstd), scale,
                                            interpret=kernel == "interpret")
    dx = dx.reshape(x.shape)
  else:
    xhat = (x.astype(jnp.float32) - mean[..., None]) * rstd[..., None]
    dyf = dy.astype(jnp.float32)
    g = dyf * scale.astype(jnp.float32)
    dx = dres.astype(jnp.float32) + rstd[..., None] * (
        g - g.sum(-1, keepdims=True) / D - xhat * (g * xhat).sum(-1, keepdims=True) / D)
    axes = tuple(range(x.ndim - 1))
    dx, dscale, dbias = dx.astype(x.dtype), (dyf * xhat).sum(axes), dyf.sum(axes)
  return dx, (None if alone else dx), dscale.astype(scale.dtype), dbias.astype(scale.dtype)


_residual_norm.defvjp(_residual_norm_fwd, _residual_norm_bwd)
