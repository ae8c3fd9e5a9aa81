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

D, N, H = 20, 3, 8  # D != N * H, so a mixed-up reshape cannot go unnoticed


def _linear(dtype, **kwargs):
  return nnx.LinearGeneral(D, (N, H), dtype=dtype, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0), **kwargs)


def _grads(fn, linear, x):
  """d/d(kernel, bias, x) of sum(fn(linear, x) * w), w fixed: every output element weighed differently."""
  w = jax.random.normal(jax.random.key(7), (*x.shape[:-1], N, H))
  graphdef, params = nnx.split(linear)
  def loss(params, x):
    return (fn(nnx.merge(graphdef, params), x).astype(jnp.float32) * w).sum()
  dparams, dx = jax.grad(loss, argnums=(0, 1))(params, x)
  return dparams["kernel"][...], dparams["bias"][...], dx


@pytest.mark.parametrize("lead", [(2, 5), (7,), (2, 3, 4)], ids=["B2-T5", "unbatched-T7", "two-batch-dims"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_values_and_gradients_match_the_layer_and_float64(dtype, lead):
  linear = _linear(dtype)
  x = jax.random.normal(jax.random.key(1), (*lead, D)).astype(dtype)  # (*batch, T, D)
  y = projection.heads(linear, x)
  assert y.shape == (*lead, N, H) and y.dtype == linear(x).dtype
  kernel, bias = (np.asarray(p[...], np.float64) for p in (linear.kernel, linear.bias))
  y64 = np.einsum("...d,dnh->...nh", np.asarray(x, np.float64), kernel) + bias
  reference.assert_close(y, y64, dtype, "out", "heads(x)")
  reference.assert_close(y, linear(x), dtype, "out", "heads(x) vs linear(x)")
  ours, theirs = _grads(projection.heads, linear, x), _grads(lambda l, x: l(x), linear, x)
  for a, b, what in zip(ours, theirs, ("d kernel", "d bias", "d x")):
    reference.assert_close(a, b, dtype, "grad", what)


def test_the_program_is_one_2d_dot_and_a_vector_bias():
  linear, x = _linear(jnp.bfloat16), jnp.ones((2, 5, D))
  jaxpr = str(jax.make_jaxpr(lambda x: projection.heads(linear, x))(x))
  assert f"bf16[{D},{N * H}]" in jaxpr and f"bf16[{N * H}]" in jaxpr, jaxpr  # (D, N * H) kernel, (N * H,) bias
  assert f"bf16[1,1,{N},{H}]" not in jaxpr, jaxpr  # not Flax's (1, 1, N, H) broadcast


def test_without_bias():
  linear = nnx.LinearGeneral(D, (N, H), use_bias=False, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (4, D))
  reference.assert_close(projection.heads(linear, x), linear(x), jnp.float32, "out")


def test_promote_dtype_sees_the_parameters_own_shapes():
  seen = []
  def promote(arrays, dtype=None):
    seen.append(tuple(None if a is None else a.shape for a in arrays))
    return nnx.nn.dtypes.promote_dtype(arrays, dtype=dtype)
  linear = _linear(jnp.float32, promote_dtype=promote)
  x = jnp.ones((2, D))
  reference.assert_close(projection.heads(linear, x), linear(x), jnp.float32, "out")
  assert seen[0] == ((2, D), (D, N, H), (N, H)), seen


def test_what_it_does_not_cover_runs_as_the_layer():
  calls = []
  def counting(*args, **kwargs):
    calls.append(1)
    return jax.lax.dot_general(*args, **{k: v for k, v in kwargs.items() if k != "out_sharding"})
  custom = _linear(jnp.float32, dot_general=counting)
  x = jnp.ones((2, D))
  np.testing.assert_array_equal(projection.heads(custom, x), custom(x))
  assert len(calls) == 2  # heads ran the layer's own call, with its dot_general

  class Doubled(nnx.LinearGeneral):  # a subclass may compute something else: its own call runs
    def __call__(self, inputs, out_sharding=None):
      return 2 * super().__call__(inputs, out_sharding=out_sharding)
  doubled = Doubled(D, (N, H), rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(projection.heads(doubled, x), doubled(x))

  two_axes = nnx.LinearGeneral((2, D), (N, H), axis=(-2, -1), rngs=nnx.Rngs(0))
  x2 = jnp.ones((3, 2, D))
  np.testing.assert_array_equal(projection.heads(two_axes, x2), two_axes(x2))
  assert [projection.plain(l) for l in (custom, doubled, two_axes, _linear(jnp.float32))] == [False] * 3 + [True]


def test_layer_keeps_flax_refusals():
  """inputs_v without inputs_k, and no decode setting at all, are errors in both classes."""
  x = jnp.ones((1, 4, D))
  for cls, extra in ((MultiHeadAttention, {"backend": "xla"}), (nnx.MultiHeadAttention, {})):
    layer = cls(num_heads=2, in_features=D, decode=False, rngs=nnx.Rngs(0), **extra)
    with pytest.raises(ValueError, match="`inputs_k` cannot be None if `inputs_v` is not None"):
      layer(x, None, x)
    undecided = cls(num_heads=2, in_features=D, rngs=nnx.Rngs(0), **extra)  # decode neither built in nor passed
    with pytest.raises(ValueError, match="No `decode` argument was provided"):
      undecided(x)
