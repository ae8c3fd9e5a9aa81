"""LayerNorm that also hands back its input, so that its backward adds the residual stream's gradient.

Letters: B batch, T sequence, D features.

`residual_norm(ln, x)` returns (x, ln(x)) for an nnx.LayerNorm `ln`, with ln(x) computed by the same
formula as flax's (float32 statistics, variance E[x^2] - E[x]^2, scale and bias cast to the compute
dtype). A pre-norm block reads the residual stream x twice, into the LayerNorm and past it; taking x
back from here routes the stream's gradient into this op's backward, which returns
dres + LayerNorm'(dy) in one pass: on a GPU one Pallas kernel (models.norm_grad), elsewhere the same
float32 formula as XLA fusions (models.kernels picks; `kernel` as there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from models import kernels, norm_grad


def residual_norm(ln: nnx.LayerNorm, x: Float[Array, "B T D"], *,
                  kernel: str = "auto") -> tuple[Float[Array, "B T D"], Float[Array, "B T D"]]:
  """(x, ln(x)); differentiable in x and ln's scale and bias (reverse mode)."""
  if ln.reduction_axes not in (-1, (-1,)) or ln.feature_axes not in (-1, (-1,)) or ln.scale is None or \
      ln.bias is None or not ln.use_fast_variance or ln.axis_name is not None:
    raise ValueError("residual_norm takes a LayerNorm over the last axis with scale and bias, fast variance and no "
                     "axis_name (the model's own); call the module itself for others")
  dtype = ln.dtype or jnp.result_type(x, ln.scale[...], ln.bias[...])
  if x.dtype != dtype:  # flax would compute in dtype; x handed back in it would change the residual stream's dtype
    raise ValueError(f"residual_norm hands x back unchanged, so x must already be in the LayerNorm's compute dtype "
                     f"{jnp.dtype(dtype).name}; got {x.dtype} (cast x first, or call the module itself)")
  scale, bias = (jnp.asarray(v, dtype) for v in (ln.scale[...], ln.bias[...]))  # as flax promotes them
  kernel, _ = kernels.resolve(kernel, x)
  return _residual_norm(x, scale, bias, float(ln.epsilon), kernel)


def _stats(x, eps: float):
  """Each row's float32 mean and 1 / sqrt(var + eps), var = E[x^2] - E[x]^2 clipped at 0 (flax's fast variance)."""
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1)
  var = jnp.maximum((xf * xf).mean(-1) - mean * mean, 0.0)
  return mean, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _residual_norm(x, scale, bias, eps, kernel):
  return _residual_norm_fwd(x, scale, bias, eps, kernel)[0]


def _residual_norm_fwd(x, scale, bias, eps, kernel):
  mean, rstd = _stats(x, eps)  # (B, T) each
  y = (x - mean[..., None]) * (rstd[..., None] * scale) + bias  # float32, in flax's order of operations
  return (x, y.astype(x.dtype)), (x, mean, rstd, scale)


def _residual_norm_bwd(eps, kernel, residuals, cotangents):
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
  return dx, dscale.astype(scale.dtype), dbias.astype(scale.dtype)


_residual_norm.defvjp(_residual_norm_fwd, _residual_norm_bwd)
