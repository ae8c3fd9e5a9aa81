"""models.gelu: jax.nn.gelu's values, and a derivative that matches a float64 formula and jax's own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.gelu import gelu
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_are_jax_gelu(dtype):
  x = _x(dtype)
  y = jax.jit(gelu)(x)
  assert y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(jax.jit(jax.nn.gelu)(x), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_matches_float64_formula_and_jax(dtype):
  x = _x(dtype)
  w = jnp.asarray(np.random.default_rng(0).normal(size=x.shape), dtype)  # an incoming gradient that varies
  dx = jax.jit(jax.grad(lambda x: jnp.sum((gelu(x) * w).astype(jnp.float32))))(x)
  assert dx.dtype == x.dtype
  reference.assert_close(dx, _dgelu64(x) * np.asarray(w, np.float64), dtype, "grad", "d gelu")
  jax_dx = jax.grad(lambda x: jnp.sum((jax.nn.gelu(x.astype(jnp.float32)) * w.astype(jnp.float32))))(x)
  reference.assert_close(dx, jax_dx, dtype, "grad", "d gelu vs jax.grad(jax.nn.gelu) in float32")
