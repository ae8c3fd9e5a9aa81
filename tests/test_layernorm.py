"""models.ops.layernorm.residual_norm: flax's LayerNorm values, and gradients (the residual stream's added) against
the float64 formula, on XLA's fusions and on models.ops.norm_fwd's and models.ops.norm_grad's Pallas kernels
(interpreted), with and without a branch's output added to the stream; the model on both."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.ops import norm_fwd, norm_grad
from models.ops.layernorm import residual_norm
from tests import reference
from train.step import batch_loss

B, T, D = 3, 5, 48  # N = 15 rows: no multiple of the kernel's tile; D = 48: no power of two (64 lanes, 16 masked)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
KERNELS = ("xla", "interpret")


def _ln(dtype, d=D):
  ln = nnx.LayerNorm(d, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  k1, k2 = jax.random.split(jax.random.key(1))
  ln.scale[...] = 1 + 0.3 * jax.random.normal(k1, (d,))  # not the initial ones and zeros: both reach the result
  ln.bias[...] = 0.3 * jax.random.normal(k2, (d,))
  return ln


def _inputs(dtype, d=D, b=B, t=T):
  kx, kr, ky = jax.random.split(jax.random.key(0), 3)
  x = (2 * jax.random.normal(kx, (b, t, d)) + 0.5).astype(dtype)  # (B, T, D), mean and spread not 0 and 1
  return x, jax.random.normal(kr, (b, t, d)).astype(dtype), jax.random.normal(ky, (b, t, d)).astype(dtype)


def _vjp(fn, ln, x, dres, dy):
  """((x out, y), dx, dscale, dbias) of fn(module, x) -> (x, y) with cotangents (dres, dy)."""
  graphdef, params = nnx.split(ln, nnx.Param)
  out, vjp = jax.vjp(lambda p, x: fn(nnx.merge(graphdef, p), x), params, x)
  dparams, dx = vjp((dres, dy))
  return out, dx, dparams["scale"][...], dparams["bias"][...]


def _oracle(ln, x, dres, dy):
  """float64 (y, dx, dscale, dbias): scale and bias rounded to x's dtype first, as flax's LayerNorm does."""
  cast = lambda a: np.asarray(jnp.asarray(a, x.dtype), np.float64)
  s, b, xx, dr, dyy = cast(ln.scale[...]), cast(ln.bias[...]), cast(x), cast(dres), cast(dy)
  mean = xx.mean(-1, keepdims=True)
  rstd = 1 / np.sqrt(((xx - mean) ** 2).mean(-1, keepdims=True) + ln.epsilon)
  xhat = (xx - mean) * rstd
  g = dyy * s
  dx = dr + rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
  return xhat * s + b, dx, (dyy * xhat).sum((0, 1)), dyy.sum((0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_are_flax_layernorm(dtype):
  ln, (x, _, _) = _ln(DTYPES[dtype]), _inputs(DTYPES[dtype])
  x_out, y = jax.jit(lambda x: residual_norm(ln, x, kernel="xla"))(x)
  assert x_out.dtype == y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(x_out, np.float32), np.asarray(x, np.float32))
  reference.assert_close(y, jax.jit(ln)(x), dtype, "out", "residual_norm vs nnx.LayerNorm")
  reference.assert_close(y, _oracle(ln, x, x, x)[0], dtype, "out", "residual_norm vs float64")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_float64(dtype, kernel):
  ln, (x, dres, dy) = _ln(DTYPES[dtype]), _inputs(DTYPES[dtype])
  _, dx, dscale, dbias = jax.jit(lambda x, dr, dy: _vjp(lambda m, x: residual_norm(m, x, kernel=kernel), ln, x, dr, dy))(
      x, dres, dy)
  assert dx.dtype == x.dtype and dscale.dtype == dbias.dtype == jnp.float32  # the parameters' dtype
  _, dx64, dscale64, dbias64 = _oracle(ln, x, dres, dy)
  reference.assert_close(dx, dx64, dtype, "grad", "dx (the residual stream's gradient added)")
  reference.assert_close(dscale, dscale64, dtype, "grad", "dscale")
  reference.assert_close(dbias, dbias64, dtype, "grad", "dbias")


@pytest.mark.parametrize("kernel", KERNELS)
def test_gradients_match_flax_autodiff(kernel):
  """float32: the same gradients as differentiating x -> (x, nnx.LayerNorm(x))."""
  ln, (x, dres, dy) = _ln(jnp.float32), _inputs(jnp.float32)
  ours = _vjp(lambda m, x: residual_norm(m, x, kernel=kernel), ln, x, dres, dy)
  flax = _vjp(lambda m, x: (x, m(x)), ln, x, dres, dy)
  for a, b, what in zip(ours[1:], flax[1:], ("dx", "dscale", "dbias")):
    reference.assert_close(a, b, jnp.float32, "grad", what)


@pytest.mark.parametrize("kernel", KERNELS)
def test_layernorm_without_bias_is_flax_values_and_gradients(kernel):
  """use_bias=False (GPTConfig.bias False): flax's LayerNorm without bias, values and gradients, float32; its
  parameters are the scale alone."""
  ln, (x, dres, dy) = nnx.LayerNorm(D, use_bias=False, rngs=nnx.Rngs(0)), _inputs(jnp.float32)
  ln.scale[...] = 1 + 0.3 * jax.random.normal(jax.random.key(1), (D,))
  graphdef, params = nnx.split(ln, nnx.Param)
  def vjp(fn):
    out, back = jax.vjp(lambda p, x: fn(nnx.merge(graphdef, p), x), params, x)
    return out, back((dres, dy))
  (s, y), (dparams, dx) = jax.jit(lambda: vjp(lambda m, x: residual_norm(m, x, kernel=kernel)))()
  (_, y_flax), (dparams_flax, dx_flax) = jax.jit(lambda: vjp(lambda m, x: (x, m(x))))()
  assert set(dparams) == {"scale"}
  reference.assert_close(y, y_flax, jnp.float32, "out", "residual_norm vs nnx.LayerNorm(use_bias=False)")
  reference.assert_close(dx, dx_flax, jnp.float32, "grad", "dx")
  reference.assert_close(dparams["scale"][...], dparams_flax["scale"][...], jnp.float32, "grad", "dscale")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_added_branch_values_and_gradients(dtype, kernel):
  """residual_norm(ln, x, a): the stream x + a rounded to the dtype, its LayerNorm, and dres + LayerNorm'(dy)
  for both x and a."""
  ln, (x, dres, dy) = _ln(DTYPES[dtype]), _inputs(DTYPES[dtype])
  a = (0.7 * jax.random.normal(jax.random.key(5), x.shape)).astype(x.dtype)
  def fn(ln, x, a, dres, dy):
    graphdef, params = nnx.split(ln, nnx.Param)
    out, vjp = jax.vjp(lambda p, x, a: residual_norm(nnx.merge(graphdef, p), x, a, kernel=kernel), params, x, a)
    return out, vjp((dres, dy))
  (s, y), (dparams, dx, da) = jax.jit(fn, static_argnums=0)(ln, x, a, dres, dy)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(x + a, np.float32))
  y64, dx64, dscale64, dbias64 = _oracle(ln, x + a, dres, dy)
  reference.assert_close(y, y64, dtype, "out", "ln(x + a)")
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(da, np.float32))
  reference.assert_close(dx, dx64, dtype, "grad", "dx = da")
  reference.assert_close(dparams["scale"][...], dscale64, dtype, "grad", "dscale")
  reference.assert_close(dparams["bias"][...], dbias64, dtype, "grad", "dbias")


@pytest.mark.parametrize("rows", [1, 4])
def test_forward_kernel_ragged_rows_and_masked_lanes(rows, monkeypatch):
  """norm_fwd interpreted against the formula: D = 65, and with 4 rows per program N not a multiple of them."""
  monkeypatch.setattr(norm_fwd, "ROWS", rows)
  N, d = 4 * rows + 3, 65
  ks = jax.random.split(jax.random.key(3), 4)
  x, y = (2 * jax.random.normal(k, (N, d)) + 1 for k in ks[:2])
  scale, bias = jax.random.normal(ks[2], (d,)), jax.random.normal(ks[3], (d,))
  s, h, mean, rstd = norm_fwd.add_norm(x, y, scale, bias, 1e-5, interpret=True)
  want = x + y
  m, r = want.mean(-1), 1 / jnp.sqrt(want.var(-1) + 1e-5)
  reference.assert_close(s, want, jnp.float32, "out", "s")
  reference.assert_close(mean, m, jnp.float32, "out", "mean")
  reference.assert_close(rstd, r, jnp.float32, "out", "rstd")
  reference.assert_close(h, (want - m[:, None]) * r[:, None] * scale + bias, jnp.float32, "out", "h")
  assert norm_fwd.add_norm(x, None, scale, bias, 1e-5, interpret=True)[0] is x


def test_kernel_sizes_beyond_one_program_each():
  """More rows than programs, a ragged last tile, and D one past a power of two, interpreted against XLA's."""
  N, d = 2 * norm_grad.PROGRAMS * norm_grad.ROWS + 3, 65
  ks = jax.random.split(jax.random.key(2), 4)
  x, dy, dres = (jax.random.normal(k, (N, d)) for k in ks[:3])
  scale = jax.random.normal(ks[3], (d,))
  mean, rstd = x.mean(-1), 1 / jnp.sqrt(x.var(-1) + 1e-6)
  dx, dscale, dbias = norm_grad.norm_grad(x, dy, dres, mean, rstd, scale, interpret=True)
  xhat, g = (x - mean[:, None]) * rstd[:, None], dy * scale
  want = dres + rstd[:, None] * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
  reference.assert_close(dx, want, jnp.float32, "grad", "dx")
  reference.assert_close(dscale, (dy * xhat).sum(0), jnp.float32, "grad", "dscale")
  reference.assert_close(dbias, dy.sum(0), jnp.float32, "grad", "dbias")


def test_interpret_runs_the_pallas_kernel():
  ln, (x, dres, dy) = _ln(jnp.float32), _inputs(jnp.float32)
  jaxpr = lambda kernel: str(jax.make_jaxpr(lambda x: _vjp(lambda m, x: residual_norm(m, x, kernel=kernel), ln, x,
                                                           dres, dy))(x))
  assert jaxpr("interpret").count("pallas_call") == 2 and "pallas_call" not in jaxpr("xla")  # forward, backward


def test_other_layernorms_and_shapes_are_refused():
  x = _inputs(jnp.float32)[0]
  with pytest.raises(ValueError, match="residual_norm takes a LayerNorm over the last axis with a scale"):
    residual_norm(nnx.LayerNorm(D, use_scale=False, rngs=nnx.Rngs(0)), x)
  with pytest.raises(ValueError, match=re.escape("x must already be in the LayerNorm's compute dtype bfloat16; got "
                                                 "float32")):
    residual_norm(_ln(jnp.bfloat16), x)
  with pytest.raises(ValueError, match=re.escape("norm_grad wants at least one row and one feature; got (N, D) = "
                                                 "(0, 8)")):
    norm_grad.norm_grad(*(jnp.zeros((0, 8)),) * 3, jnp.zeros(0), jnp.zeros(0), jnp.zeros(8), interpret=True)
  with pytest.raises(ValueError, match=re.escape("norm_grad wants x, dy, dres (N, D) = (4, 8), mean and rstd (4,), "
                                                 "scale (8,); got (4, 8), (4, 8), (4,), (4,), (9,)")):
    z = jnp.zeros((4, 8))
    norm_grad.norm_grad(z, z, z, z[:, 0], z[:, 0], jnp.zeros(9), interpret=True)
  with pytest.raises(ValueError, match=re.escape("y must have x's shape and dtype (3, 5, 48) float32; got (3, 5, 48) "
                                                 "bfloat16")):
    residual_norm(_ln(jnp.float32), x, x.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match=re.escape("add_norm wants x and y (N, D) = (4, 8), scale and bias (8,); got "
                                                 "(4, 8), (9,), (8,)")):
    z = jnp.zeros((4, 8))
    norm_fwd.add_norm(z, z, jnp.zeros(9), jnp.zeros(8), 1e-5, interpret=True)
  with pytest.raises(ValueError, match=re.escape("kernels must be one of ('auto', 'xla', 'pallas', 'interpret') "
                                                 "(models.kernels); got 'triton'")):
    models.preset("tiny", kernels="triton")


def test_model_loss_and_gradients_on_both_kernels(kernels=KERNELS, **overrides):
  """The whole training loss of a small float32 GPT: the Pallas kernels (interpreted) give XLA's loss and
  gradients."""
  cfg = dataclasses.replace(models.preset("tiny", seq_len=16), n_layer=2, **overrides)
  x = jax.random.randint(jax.random.key(1), (3, 16), 0, cfg.vocab_size)  # (B, T)
  batch = {"inputs": x, "targets": jnp.roll(x, -1, axis=1)}
  result = {}
  for kernel in kernels:
    graphdef, params, fp8 = nnx.split(models.GPT(dataclasses.replace(cfg, kernels=kernel), rngs=nnx.Rngs(0)),
                                      nnx.Param, ...)
    result[kernel] = jax.jit(jax.value_and_grad(lambda p: batch_loss(graphdef, p, fp8, batch, None)))(params)
  (lx, gx), (lp, gp) = result["xla"], result[kernels[1]]
  reference.assert_close(lp, lx, jnp.float32, "out", "loss")
  jax.tree.map(lambda a, b: reference.assert_close(a, b, jnp.float32, "grad", "parameter gradient"), gp, gx)
