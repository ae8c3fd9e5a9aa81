"""segment_ids= and sliding windows through attnlayers.nnx and attnlayers.linen (issue 12, the layers), on a CPU.

A layer call with them equals the core called on the layer's own projections; the constructor's
sliding_window is the default a call overrides; nnx and linen agree; and the calls they refuse.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
import attnlayers.linen as al
from attnlayers.nnx import MultiHeadAttention
from tests import reference

N, D = 4, 32
SEG = jnp.array([[1, 1, 1, 2, 2, 3, 3, 0], [4, 4, 4, 4, 4, 4, 4, 4]], jnp.int32)  # (B, T); 0 = padding
x = jax.random.normal(jax.random.key(1), (2, 8, D))


def layer(backend="xla", kv_heads=2, **kwargs):
  return MultiHeadAttention(N, D, num_kv_heads=kv_heads, decode=False, backend=backend, is_causal=True,
                            rngs=nnx.Rngs(0), **kwargs)


def by_hand(m, x, **options):
  """The layer's steps written out: its projections, attnlayers.attention, its output projection."""
  q, k, v = m.query(x), m.key(x), m.value(x)
  return m.out(attnlayers.attention(q, k, v, backend="naive", is_causal=True, **options))


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("backend", ["naive", "xla", "auto"])
def test_nnx_segments_and_window_equal_the_core(backend, kv_heads):
  m = layer(backend, kv_heads)
  for options in (dict(segment_ids=SEG), dict(window=(2, 0)), dict(segment_ids=SEG, window=(1, 0))):
    got = m(x, segment_ids=options.get("segment_ids"), sliding_window=options.get("window"))
    reference.assert_close(got, by_hand(m, x, **options), jnp.float32, what=f"{backend} {kv_heads} {list(options)}")
  np.testing.assert_array_equal(m(x, segment_ids=jnp.ones((2, 8), jnp.int32)), m(x))  # one document: plain causal


def test_constructor_window_is_the_default_a_call_overrides():
  windowed, plain = layer(sliding_window=(2, 0)), layer()
  np.testing.assert_array_equal(windowed(x), plain(x, sliding_window=(2, 0)))
  np.testing.assert_array_equal(windowed(x, sliding_window=None), plain(x))
  assert not np.allclose(windowed(x), plain(x))


def test_linen_equals_nnx_with_segments_and_window():
  m = layer(sliding_window=(3, 0))
  params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
  ours = al.MultiHeadDotProductAttention(num_heads=N, num_kv_heads=2, backend="xla", is_causal=True,
                                         sliding_window=(3, 0))
  np.testing.assert_array_equal(ours.apply({"params": params}, x, segment_ids=SEG), m(x, segment_ids=SEG))
  np.testing.assert_array_equal(ours.apply({"params": params}, x, sliding_window=None), m(x, sliding_window=None))


def test_window_while_decoding_equals_the_windowed_forward():
  m = layer(sliding_window=(2, 0))
  full = m(x)
  m.init_cache((2, 8, D))
  parts = [m(x[:, :5], decode=True)] + [m(x[:, t:t + 1], decode=True) for t in range(5, 8)]
  reference.assert_close(jnp.concatenate(parts, axis=1), full, jnp.float32, what="windowed decode vs forward")


def test_refused_calls():
  with pytest.raises(ValueError, match="two ints >= 0"):
    layer(sliding_window=(2,))
  m = layer()
  m.init_cache((2, 8, D))
  with pytest.raises(ValueError, match="segment_ids= with a KV cache"):
    m(x[:, :2], decode=True, segment_ids=SEG[:, :2])
  custom = MultiHeadAttention(N, D, decode=False, attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="custom attention_fn"):
    custom(x, segment_ids=SEG)
  lin = al.MultiHeadDotProductAttention(num_heads=N, attention_fn=nnx.dot_product_attention)
  params = lin.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="custom attention_fn"):
    lin.apply(params, x, sliding_window=(1, 0))


def test_segment_ids_that_are_not_an_array_get_the_cores_error():
  """A nested list reached `ids.ndim` in the layers' adapter: AttributeError: 'int' object has no attribute 'ndim'."""
  with pytest.raises(TypeError, match=r"must be an array .* Wrap it with jnp.asarray\(\)"):
    layer()(x, segment_ids=np.asarray(SEG).tolist())
