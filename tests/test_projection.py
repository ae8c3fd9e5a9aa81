"""attnlayers.projection.heads: a q/k/v projection as a 2-D GEMM gives the LinearGeneral's values and
gradients from the same parameters, and hands every projection it does not cover to the layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlayers import projection
from attnlayers.nnx import MultiHeadAttention
from tests import reference

D, N, H = 24, 3, 8


def _linear(dtype, **kwargs):
  return nnx.LinearGeneral(D, (N, H), dtype=dtype, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0), **kwargs)


def _grads(fn, linear, x):
  """d/d(x, kernel, bias) of sum(fn(linear, x) * w), w fixed: every output element weighed differently."""
  w = jax.random.normal(jax.random.key(7), (*x.shape[:-1], N, H))
  graphdef, params = nnx.split(linear)
  def loss(params, x):
    return (fn(nnx.merge(graphdef, params), x).astype(jnp.float32) * w).sum()
  dparams, dx = jax.grad(loss, argnums=(0, 1))(params, x)
  return dparams["kernel"][...], dparams["bias"][...], dx


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_values_and_gradients_match_the_layer_and_float64(dtype):
  linear = _linear(dtype)
  x = jax.random.normal(jax.random.key(1), (2, 5, D))  # (B, T, D)
  y = projection.heads(linear, x)
  assert y.shape == (2, 5, N, H) and y.dtype == linear(x).dtype
  kernel, bias = (np.asarray(p[...], np.float64) for p in (linear.kernel, linear.bias))
  y64 = np.einsum("btd,dnh->btnh", np.asarray(x, np.float64), kernel) + bias
  reference.assert_close(y, y64, dtype, "out", "heads(x)")
  reference.assert_close(y, linear(x), dtype, "out", "heads(x) vs linear(x)")
  ours, theirs = _grads(projection.heads, linear, x), _grads(lambda l, x: l(x), linear, x)
  for a, b, what in zip(ours, theirs, ("d kernel", "d bias", "d x")):
    reference.assert_close(a, b, dtype, "grad", what)


def test_the_program_is_one_2d_dot_and_a_vector_bias():
  linear, x = _linear(jnp.bfloat16), jnp.ones((2, 5, D))
  jaxpr = str(jax.make_jaxpr(lambda x: projection.heads(linear, x))(x))
  assert "dot_general" in jaxpr and f"bf16[{N * H}]" in jaxpr, jaxpr  # the bias added as an (N * H,) vector
  assert f"bf16[1,1,{N},{H}]" not in jaxpr, jaxpr  # not Flax's (1, 1, N, H) broadcast


def test_without_bias():
  linear = nnx.LinearGeneral(D, (N, H), use_bias=False, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, D))
  reference.assert_close(projection.heads(linear, x), linear(x), jnp.float32, "out")


def test_custom_dot_general_and_other_axes_run_as_the_layer():
  calls = []
  def counting(*args, **kwargs):
    calls.append(1)
    return jax.lax.dot_general(*args, **{k: v for k, v in kwargs.items() if k != "out_sharding"})
  custom = _linear(jnp.float32, dot_general=counting)
  assert not projection.plain(custom)
  x = jnp.ones((2, D))
  np.testing.assert_array_equal(projection.heads(custom, x), custom(x))
  assert len(calls) == 2  # heads ran the layer's own call, with its dot_general
  two_axes = nnx.LinearGeneral((2, D), (N, H), axis=(-2, -1), rngs=nnx.Rngs(0))
  assert not projection.plain(two_axes)
  x2 = jnp.ones((3, 2, D))
  np.testing.assert_array_equal(projection.heads(two_axes, x2), two_axes(x2))
  assert projection.plain(_linear(jnp.float32))


def test_layer_refuses_inputs_v_without_inputs_k_as_flax_does():
  layer = MultiHeadAttention(num_heads=2, in_features=D, decode=False, backend="xla", rngs=nnx.Rngs(0))
  flax = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 4, D))
  for l in (layer, flax):
    with pytest.raises(ValueError, match="`inputs_k` cannot be None if `inputs_v` is not None"):
      l(x, None, x)
