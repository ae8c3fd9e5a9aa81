"""attnlayers.linen against flax.linen and against attnlayers.nnx (one set of numbers for both)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import attnlayers.linen as al
from attnlayers.nnx import MultiHeadAttention
from tests import reference

D = 32
x = jax.random.normal(jax.random.key(1), (2, 8, D))
mask = jax.random.bernoulli(jax.random.key(2), 0.7, (2, 1, 8, 8)).at[..., 0].set(True).astype(jnp.float32)


@pytest.mark.parametrize("cls, flax_cls", [(al.MultiHeadDotProductAttention, nn.MultiHeadDotProductAttention),
                                           (al.MultiHeadAttention, nn.MultiHeadAttention)])
def test_equals_flax_linen_from_identical_init(cls, flax_cls):
  ours, flax = cls(num_heads=4, backend="xla"), flax_cls(num_heads=4)
  vo, vf = ours.init(jax.random.key(0), x), flax.init(jax.random.key(0), x)
  jax.tree.map(np.testing.assert_array_equal, vo, vf)
  # Flax's linen attention is the einsum path; ours runs XLA's kernel: equal to float32 rounding.
  reference.assert_close(ours.apply(vo, x, mask=mask), flax.apply(vf, x, mask=mask), jnp.float32)


def test_self_attention_alias():
  ours, flax = al.SelfAttention(num_heads=4, backend="naive"), nn.SelfAttention(num_heads=4)
  vo = ours.init(jax.random.key(0), x)
  with pytest.warns(DeprecationWarning):
    ref = flax.apply(vo, x, mask)
  reference.assert_close(ours.apply(vo, x, mask), ref, jnp.float32)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("backend", ["naive", "xla"])
def test_nnx_and_linen_give_the_same_numbers(kv_heads, backend):
  layer = MultiHeadAttention(4, D, num_kv_heads=kv_heads, decode=False, backend=backend, rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
  ours = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=kv_heads, backend=backend)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x)["params"]) == jax.tree.map(jnp.shape, params)
  np.testing.assert_array_equal(ours.apply({"params": params}, x, mask=mask, is_causal=True),
                                layer(x, mask=mask, is_causal=True))


def test_construction_time_is_causal():
  causal = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2, is_causal=True)
  full = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2)
  v = causal.init(jax.random.key(0), x)
  np.testing.assert_array_equal(causal.apply(v, x), full.apply(v, x, is_causal=True))
  assert not np.allclose(causal.apply(v, x), full.apply(v, x))


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["MHA", "MQA"])
def test_decode_with_cache_equals_causal_forward(kv_heads):
  full_layer = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=kv_heads, is_causal=True)
  params = full_layer.init(jax.random.key(0), x)["params"]
  want = full_layer.apply({"params": params}, x)
  step_layer = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=kv_heads, is_causal=True, decode=True)
  cache = step_layer.init(jax.random.key(0), x)["cache"]  # shaped by the (B, max_length) input
  outs = []
  for t in range(x.shape[1]):
    out, updated = step_layer.apply({"params": params, "cache": cache}, x[:, t:t + 1], mutable=["cache"])
    cache = updated["cache"]
    outs.append(out)
  reference.assert_close(jnp.concatenate(outs, axis=1), want, jnp.float32, what="decode vs full")


def test_sow_weights():
  layer = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2)
  v = layer.init(jax.random.key(0), x)
  _, state = layer.apply(v, x, mask=mask, sow_weights=True, mutable=["intermediates"])
  weights = state["intermediates"]["attention_weights"][0]
  assert weights.shape == (2, 4, 8, 8)
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)


def test_dropout_uses_the_dropout_rng():
  layer = al.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.5, deterministic=False)
  v = layer.init(jax.random.key(0), x)
  a = layer.apply(v, x, rngs={"dropout": jax.random.key(1)})
  b = layer.apply(v, x, rngs={"dropout": jax.random.key(1)})
  c = layer.apply(v, x, rngs={"dropout": jax.random.key(2)})
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


def test_custom_attention_fn_and_backend_conflict():
  layer = al.MultiHeadDotProductAttention(num_heads=4, attention_fn=nn.dot_product_attention, backend="xla")
  with pytest.raises(ValueError, match="either attention_fn= or backend="):
    layer.init(jax.random.key(0), x)


def test_te_fp8_points_to_the_nnx_layer():
  layer = al.MultiHeadDotProductAttention(num_heads=4, backend="te-fp8")
  x = jnp.ones((1, 8, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="use attnlayers.nnx.MultiHeadAttention"):
    layer.init(jax.random.key(0), x, x)
