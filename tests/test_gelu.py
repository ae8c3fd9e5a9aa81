"""models.ops.gelu: values and derivative against the tanh formula in float64, and against jax.nn.gelu's own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.ops.gelu import gelu
from tests import reference


def _x(dtype):
  x = np.linspace(-8, 8, 4001)[:4000].astype(np.float32)  # both tails and the bend
  return jnp.asarray(x.reshape(4, -1), dtype)


def _dgelu64(x):
  """d/dx 0.5 x (1 + tanh(c (x + 0.044715 x^3))), written out in float64."""
  x = np.asarray(x, np.float64)
  c = np.sqrt(2 / np.pi)
  u = c * (x + 0.044715 * x ** 3)
  return 0.5 * (1 + np.tanh(u)) + 0.5 * x * (1 - np.tanh(u) ** 2) * c * (1 + 3 * 0.044715 * x ** 2)


def _gelu64(x):
  """0.5 x (1 + tanh(c (x + 0.044715 x^3))) in float64."""
  x = np.asarray(x, np.float64)
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_match_float64_formula_and_jax(dtype):
  x = _x(dtype)
  y = jax.jit(gelu)(x)
  assert y.dtype == x.dtype
  reference.assert_close(y, _gelu64(x), dtype, "out", "gelu")
  reference.assert_close(y, jax.nn.gelu(x.astype(jnp.float32)), dtype, "out", "gelu vs jax.nn.gelu in float32")


def test_bfloat16_values_are_the_float32_values_rounded():
  x = _x(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(gelu(x), np.float32),
                                np.asarray(gelu(x.astype(jnp.float32)).astype(jnp.bfloat16), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_matches_float64_formula_and_jax(dtype):
  x = _x(dtype)
  w = jnp.asarray(np.random.default_rng(0).normal(size=x.shape), dtype)  # an incoming gradient that varies
  dx = jax.jit(jax.grad(lambda x: jnp.sum((gelu(x) * w).astype(jnp.float32))))(x)
  assert dx.dtype == x.dtype
  reference.assert_close(dx, _dgelu64(x) * np.asarray(w, np.float64), dtype, "grad", "d gelu")
  jax_dx = jax.grad(lambda x: jnp.sum((jax.nn.gelu(x.astype(jnp.float32)) * w.astype(jnp.float32))))(x)
  reference.assert_close(dx, jax_dx, dtype, "grad", "d gelu vs jax.grad(jax.nn.gelu) in float32")
