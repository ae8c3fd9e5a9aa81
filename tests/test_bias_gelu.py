"""models.ops.bias_gelu: gelu(z + b) and its gradients in z and b against the float64 formula, on XLA's fusions and on
the Pallas kernels (interpreted), at shapes that leave tiles ragged; the MLP keeps nnx.Linear's parameters."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.ops import bias_gelu as bg
from models.ops.bias_gelu import bias_gelu
from tests import reference
from tests.test_gelu import _dgelu64, _gelu64

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
KERNELS = ("xla", "interpret")
# (B, T, F): ragged row and feature tiles; the second has more backward row tiles than programs
SHAPES = [(3, 5, 48), (2, bg.BWD_PROGRAMS * bg.BWD_TILE[0] // 2 + 5, bg.BWD_TILE[1] + 3)]


def _inputs(dtype, shape):
  kz, kb, ky = jax.random.split(jax.random.key(0), 3)
  z = (3 * jax.random.normal(kz, shape)).astype(dtype)  # both tails and the bend
  b = jax.random.normal(kb, shape[-1:]).astype(dtype)
  return z, b, jax.random.normal(ky, shape).astype(dtype)


def _oracle(z, b, dy):
  """float64 (y, dz, db)."""
  x = np.asarray(z, np.float64) + np.asarray(b, np.float64)
  g = np.asarray(dy, np.float64) * _dgelu64(x)
  return _gelu64(x), g, g.reshape(-1, g.shape[-1]).sum(0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_and_gradients_match_float64(dtype, kernel, shape):
  z, b, dy = _inputs(DTYPES[dtype], shape)
  y, dz, db = jax.jit(lambda z, b, dy: _with_vjp(z, b, dy, kernel))(z, b, dy)
  assert y.dtype == dz.dtype == db.dtype == z.dtype
  y64, dz64, db64 = _oracle(z, b, dy)
  reference.assert_close(y, y64, dtype, "out", "gelu(z + b)")
  reference.assert_close(dz, dz64, dtype, "grad", "dz")
  reference.assert_close_sum(db, db64, dtype, z.size // z.shape[-1], "db")  # a sum over the rows


def _with_vjp(z, b, dy, kernel):
  y, vjp = jax.vjp(lambda z, b: bias_gelu(z, b, kernel=kernel), z, b)
  return (y, *vjp(dy))


def test_kernels_agree_and_interpret_runs_pallas():
  z, b, dy = _inputs(jnp.float32, SHAPES[1])
  xla, pallas = (_with_vjp(z, b, dy, k) for k in KERNELS)
  for a, c, what in zip(pallas, xla, ("y", "dz", "db")):
    reference.assert_close(a, c, jnp.float32, "grad", what)
  jaxpr = lambda kernel: str(jax.make_jaxpr(lambda z, b, dy: _with_vjp(z, b, dy, kernel))(z, b, dy))
  assert jaxpr("interpret").count("pallas_call") == 2 and "pallas_call" not in jaxpr("xla")


def test_bad_inputs_are_refused():
  z = jnp.zeros((2, 3, 8))
  with pytest.raises(ValueError, match=re.escape("bias_gelu wants z (..., F) and b (F,) with the same F; got z "
                                                 "(2, 3, 8), b (9,)")):
    bias_gelu(z, jnp.zeros(9))
  with pytest.raises(ValueError, match="bias_gelu takes floating-point z and b; got int32 and float32"):
    bias_gelu(z.astype(jnp.int32), jnp.zeros(8))
  with pytest.raises(ValueError, match=re.escape("bias_gelu wants at least one row and one feature; got z (0, 8)")):
    bias_gelu(jnp.zeros((0, 8)), jnp.zeros(8))
  with pytest.raises(ValueError, match="kernel must be one of"):
    bias_gelu(z, jnp.zeros(8), kernel="triton")


def test_mlp_keeps_linear_parameters_and_values():
  """The block's fc keeps nnx.Linear's kernel and bias, and the MLP computes what gelu(fc(h)) computes (float32)."""
  cfg = models.preset("tiny", seq_len=8, dtype="float32")
  block = models.GPT(cfg, rngs=nnx.Rngs(0)).blocks[0]
  assert set(nnx.to_pure_dict(nnx.state(block.fc, nnx.Param))) == {"kernel", "bias"}
  block.fc.bias[...] = jax.random.normal(jax.random.key(3), block.fc.bias.shape)  # not the initial zeros
  h = jax.random.normal(jax.random.key(4), (2, 8, cfg.d_model))
  z = models.gpt._unbiased(block.fc, h)
  ours = bias_gelu(z, block.fc.bias[...], kernel="xla")
  reference.assert_close(ours, jax.nn.gelu(block.fc(h), approximate=True), jnp.float32, "out", "MLP hidden")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_of_gemm_matches_float64(dtype, kernel):
  """gelu_of_gemm (the bias-free MLP's GELU): y and dz against the float64 formula with b = 0."""
  z, _, dy = _inputs(DTYPES[dtype], SHAPES[1])
  y, vjp = jax.jit(lambda z: jax.vjp(lambda z: bg.gelu_of_gemm(z, kernel=kernel), z))(z)
  (dz,) = jax.jit(vjp)(dy)
  assert y.dtype == dz.dtype == z.dtype
  y64, dz64, _ = _oracle(z, jnp.zeros(z.shape[-1:]), dy)
  reference.assert_close(y, y64, dtype, "out", "gelu(z)")
  reference.assert_close(dz, dz64, dtype, "grad", "dz")


def test_gelu_of_gemm_forward_is_xla_gelu_and_backward_the_kernel():
  """With the Pallas kernels the forward is jax.nn.gelu's formula (the GEMM rewriter's pattern, no
  pallas_call) and the backward bias_gelu's kernel; with "xla" neither is a pallas_call."""
  z = jnp.ones((4, 48))
  fwd = lambda kernel: str(jax.make_jaxpr(lambda z: bg.gelu_of_gemm(z, kernel=kernel))(z))
  both = lambda kernel: str(jax.make_jaxpr(lambda z: jax.grad(lambda z: bg.gelu_of_gemm(z, kernel=kernel).sum())(z))(z))
  assert "pallas_call" not in fwd("interpret") and "tanh" in fwd("interpret")
  assert both("interpret").count("pallas_call") == 1 and "pallas_call" not in both("xla")
  with pytest.raises(ValueError, match=re.escape("gelu_of_gemm takes a non-empty floating-point z; got int32 (2, 3)")):
    bg.gelu_of_gemm(jnp.zeros((2, 3), jnp.int32))
