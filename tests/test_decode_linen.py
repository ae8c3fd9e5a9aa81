"""Decoding with attnlayers.linen's KV cache (issue 11, Linen), on a CPU: the nnx cache's contract.

One-token steps against flax.linen's own class (caches bit for bit, outputs to float32 rounding), chunked prefill
against the full causal forward, a ragged batch against its rows decoded alone, decoding
past the cache, the calls that the cache refuses, and a cache Flax's own init made (scalar
cache_index) decoded in lax.scan.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import attnlayers.linen as al
from tests import reference

N, D = 4, 32  # query heads, model width: head dim 8
KV_HEADS = {"MHA": 4, "GQA": 2, "MQA": 1}
BACKENDS = ["naive", "xla", "auto"]


def tokens(*shape, seed=1):
  return jax.random.normal(jax.random.key(seed), (*shape, D))


def layer(backend, kv_heads, **kwargs):
  return al.MultiHeadDotProductAttention(num_heads=N, num_kv_heads=kv_heads, backend=backend, is_causal=True,
                                         **kwargs)


def params_of(kv_heads):
  """One set of parameters for every layer of a test (from the full layer's init)."""
  return layer("xla", kv_heads).init(jax.random.key(0), tokens(2, 4))["params"]


def new_cache(m, batch: int, max_length: int):
  """The init pass on a (batch, max_length, D) input shapes the cache, as in Flax."""
  return m.init(jax.random.key(0), jnp.zeros((batch, max_length, D)))["cache"]


def step(m, params, cache, x, **kwargs):
  out, updated = m.apply({"params": params, "cache": cache}, x, mutable=["cache"], **kwargs)
  return out, updated["cache"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_decode_matches_flax_linen(backend):
  """MHA (Flax's linen class has no kv heads), steps 0..4 into a cache of 8: the caches are Flax's bits; the
  outputs agree to float32 rounding, as the layers do without a cache (test_linen: Flax's linen attention
  is its einsum path, a few ulp from every backend here)."""
  params = params_of(N)
  ours, flax = layer(backend, N, decode=True), nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
  x = tokens(2, 8)
  cache_o, cache_f = new_cache(ours, 2, 8), new_cache(flax, 2, 8)
  assert cache_o["cache_index"].shape == (2,) and cache_f["cache_index"].shape == ()
  for t in range(5):
    out_o, cache_o = step(ours, params, cache_o, x[:, t:t + 1])
    out_f, cache_f = step(flax, params, cache_f, x[:, t:t + 1])
    reference.assert_close(out_o, out_f, jnp.float32, what=f"{backend} step {t}")
  for name in ("cached_key", "cached_value"):
    np.testing.assert_array_equal(cache_o[name], cache_f[name], err_msg=name)
  np.testing.assert_array_equal(cache_o["cache_index"], [5, 5])


@pytest.mark.parametrize("heads", list(KV_HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_then_steps_equal_the_causal_forward(backend, heads):
  params = params_of(KV_HEADS[heads])
  x = tokens(2, 12)
  full = layer(backend, KV_HEADS[heads]).apply({"params": params}, x)
  m = layer(backend, KV_HEADS[heads], decode=True)
  cache = new_cache(m, 2, 16)
  parts = []
  for chunk in (x[:, :5], x[:, 5:9], *(x[:, t:t + 1] for t in range(9, 12))):
    out, cache = step(m, params, cache, chunk)
    parts.append(out)
  reference.assert_close(jnp.concatenate(parts, axis=1), full, jnp.float32, what=f"{backend} {heads} decode vs full")
  np.testing.assert_array_equal(cache["cache_index"], [12, 12])


@pytest.mark.parametrize("heads", list(KV_HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_equals_each_row_decoded_alone(backend, heads):
  """A chunk of 5 with 5/2/3 real tokens under jit, then one step; each row alone eagerly with its real tokens."""
  kv_heads = KV_HEADS[heads]
  params = params_of(kv_heads)
  m = layer(backend, kv_heads, decode=True)
  prompt, nxt, real = tokens(3, 5, seed=1), tokens(3, 1, seed=2), [5, 2, 3]
  jitted = jax.jit(lambda c, x, n: step(m, params, c, x, lengths=n))
  out0, cache = jitted(new_cache(m, 3, 16), prompt, jnp.array(real, jnp.int32))
  out1, cache = jitted(cache, nxt, jnp.ones(3, jnp.int32))
  assert np.isfinite(np.asarray(out0)).all(), "outputs at padding positions must be finite"
  np.testing.assert_array_equal(cache["cache_index"], np.add(real, 1))
  for b in range(3):
    alone = new_cache(m, 1, 16)
    want0, alone = step(m, params, alone, prompt[b:b + 1, :real[b]])
    want1, alone = step(m, params, alone, nxt[b:b + 1])
    reference.assert_close(out0[b:b + 1, :real[b]], want0, jnp.float32, what=f"{backend} {heads} row {b} prompt")
    reference.assert_close(out1[b:b + 1], want1, jnp.float32, what=f"{backend} {heads} row {b} step")


LINEN_SIZE = r"\(the max_length of the \(\*batch, max_length, features\) input that init shapes the cache with\)"


def test_decoding_past_the_cache_raises():
  """nnx's words, with where a linen cache's length is set: they named init_cache, which linen has not."""
  params = params_of(2)
  m = layer("xla", 2, decode=True)
  _, cache = step(m, params, new_cache(m, 2, 6), tokens(2, 4))
  with pytest.raises(ValueError, match=r"past the KV cache: row 0 at position 4 adds 3 tokens \(to 7\).*holds 6 "
                                       rf"positions per row\. Give it at least 7 positions {LINEN_SIZE} "
                                       r"or stop earlier\."):
    step(m, params, cache, tokens(2, 3))


def test_a_custom_attention_fn_past_flaxs_cache_raises_as_the_backends_do():
  """With a custom attention_fn the layer writes Flax's way, whose dynamic_update_slice clamps an index past the
  end: a third token into a cache of 2 overwrote the last slot without a word. Eagerly it now raises."""
  m = al.MultiHeadDotProductAttention(num_heads=N, decode=True, attention_fn=nn.dot_product_attention)
  params, cache = m.init(jax.random.key(0), tokens(2, 2)).values()
  for t in range(2):
    _, cache = step(m, params, cache, tokens(2, 1, seed=t))
  with pytest.raises(ValueError, match=rf"row 0 at position 2 adds 1 token \(to 3\).*holds 2 positions per row\. "
                                       rf"Give it at least 3 positions {LINEN_SIZE}"):
    step(m, params, cache, tokens(2, 1))


@pytest.mark.parametrize("attention_fn", [None, nn.dot_product_attention], ids=["backend", "custom"])
def test_a_cache_of_length_0_is_refused_where_it_is_made(attention_fn):
  """An init input of length 0 made (with a custom attention_fn) a cache that every decode call overflowed, or (on
  the backends) failed in attention with no word of the cache; both now name the length and where it is set."""
  m = al.MultiHeadDotProductAttention(num_heads=N, decode=True, attention_fn=attention_fn)
  with pytest.raises(ValueError, match=rf"a KV cache needs max_length >= 1 position per row; got 0 {LINEN_SIZE}"):
    new_cache(m, 2, 0)


def test_refused_calls():
  params = params_of(2)
  with pytest.raises(ValueError, match="needs decode=True"):
    layer("xla", 2).apply({"params": params}, tokens(2, 4), lengths=jnp.array([4, 4]))
  m = layer("xla", 2, decode=True)
  with pytest.raises(ValueError, match=r"lengths must have shape \(2,\)"):
    step(m, params, new_cache(m, 2, 8), tokens(2, 4), lengths=jnp.array([4, 4, 4]))
  custom = al.MultiHeadDotProductAttention(num_heads=N, decode=True, attention_fn=nn.dot_product_attention)
  p = custom.init(jax.random.key(0), tokens(2, 4))["params"]
  with pytest.raises(ValueError, match="one token per call"):
    step(custom, p, new_cache(custom, 2, 8), tokens(2, 3))


def test_self_attention_takes_lengths_as_the_layer_does():
  """SelfAttention (Flax's self-attention form) decodes as MultiHeadDotProductAttention; a ragged chunk's
  lengths= ended in "SelfAttention.__call__() got an unexpected keyword argument 'lengths'"."""
  params = params_of(2)
  full = layer("xla", 2, decode=True)
  selfattn = al.SelfAttention(num_heads=N, num_kv_heads=2, backend="xla", is_causal=True, decode=True)
  x, real = tokens(2, 4), jnp.array([4, 2], jnp.int32)
  want, want_cache = step(full, params, new_cache(full, 2, 8), x, lengths=real)
  got, got_cache = step(selfattn, params, new_cache(selfattn, 2, 8), x, lengths=real)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got_cache["cache_index"], [4, 2])


def scan_steps(m, variables, x):
  """Decodes x (B, T, D) one token per step inside lax.scan, the cache as the carry: (outputs (B, T, D), cache)."""
  def body(cache, xt):  # xt (B, D)
    out, cache = step(m, variables["params"], cache, xt[:, None])
    return cache, out[:, 0]
  cache, outs = jax.lax.scan(body, variables["cache"], x.swapaxes(0, 1))  # outs (T, B, D)
  return outs.swapaxes(0, 1), cache


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["F32", "BF16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_on_a_cache_flax_made_matches_flax_and_keeps_its_scalar_index(backend, dtype):
  """The parameters and cache of Flax's own layer's init (cache_index: one int32 scalar for the batch), decoded
  token by token in lax.scan by both layers. The scan raised "carry input and carry output must have equal
  types": the index came back as (B,), one position per row."""
  flax = nn.MultiHeadDotProductAttention(num_heads=N, decode=True, dtype=dtype)
  ours = al.MultiHeadDotProductAttention(num_heads=N, decode=True, dtype=dtype, backend=backend)
  x = tokens(2, 6).astype(dtype)
  variables = flax.init(jax.random.key(0), x)
  assert variables["cache"]["cache_index"].shape == ()
  out_o, cache_o = scan_steps(ours, variables, x)
  out_f, cache_f = scan_steps(flax, variables, x)
  reference.assert_close(out_o.astype(jnp.float32), out_f.astype(jnp.float32), dtype, what=f"{backend} scan")
  index = cache_o["cache_index"]
  assert (index.shape, index.dtype) == ((), jnp.int32), (index.shape, index.dtype)
  np.testing.assert_array_equal(index, 6)
  for name in ("cached_key", "cached_value"):
    np.testing.assert_array_equal(cache_o[name], cache_f[name], err_msg=name)


def test_lengths_on_a_cache_flax_made_is_refused():
  """A scalar cache_index cannot hold rows of different lengths; the error says where a per-row cache comes from
  (before, the call promoted the index to (B,) and so changed the cache's type)."""
  flax = nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
  ours = layer("xla", N, decode=True)
  variables = flax.init(jax.random.key(0), tokens(2, 8))
  with pytest.raises(ValueError, match=r"lengths= needs one position per row.*\(2,\) rows.*attnlayers' layer"):
    step(ours, variables["params"], variables["cache"], tokens(2, 3), lengths=jnp.array([3, 1], jnp.int32))


def test_custom_attention_fn_decodes_on_the_layers_own_cache_as_flax_does():
  """A cache the layer's own init made (cache_index (B,)) decoded one token per call by the layer with a custom
  attention_fn: outputs and caches equal Flax's class with that attention_fn on its own cache, bit for bit, also
  inside lax.scan, and the index stays (B,) int32. It raised "start_indices arguments to dynamic_update_slice must
  be scalars" (Flax's cache update took the per-row index). Past the cache's end it is refused, where Flax's
  clamped index silently overwrites the last position."""
  params = params_of(N)
  flax = nn.MultiHeadDotProductAttention(num_heads=N, decode=True, attention_fn=nn.dot_product_attention)
  custom = al.MultiHeadDotProductAttention(num_heads=N, decode=True, attention_fn=nn.dot_product_attention)
  x = tokens(2, 6)
  cache_o, cache_f = new_cache(layer("xla", N, decode=True), 2, 6), new_cache(flax, 2, 6)
  assert cache_o["cache_index"].shape == (2,) and cache_f["cache_index"].shape == ()
  out_o, scanned_o = scan_steps(custom, {"params": params, "cache": cache_o}, x)
  out_f, scanned_f = scan_steps(flax, {"params": params, "cache": cache_f}, x)
  np.testing.assert_array_equal(out_o, out_f)
  for name in ("cached_key", "cached_value"):
    np.testing.assert_array_equal(scanned_o[name], scanned_f[name], err_msg=name)
  index = scanned_o["cache_index"]
  assert (index.shape, index.dtype, index.tolist()) == ((2,), jnp.int32, [6, 6])
  for t in range(2):  # eagerly too
    out_o, cache_o = step(custom, params, cache_o, x[:, t:t + 1])
    out_f, cache_f = step(flax, params, cache_f, x[:, t:t + 1])
    np.testing.assert_array_equal(out_o, out_f)
  with pytest.raises(ValueError, match=r"decoding past the KV cache: row 0 at position 6 adds 1 token"):
    step(custom, params, scanned_o, x[:, :1])


def test_custom_attention_fn_decodes_each_row_at_its_own_position():
  """Rows prefilled to different lengths (lengths=, the layer's own backend), then decoded by the custom
  attention_fn: each row attends only its own cached tokens, as Flax's class decoding that row alone."""
  params = params_of(N)
  flax = nn.MultiHeadDotProductAttention(num_heads=N, decode=True, attention_fn=nn.dot_product_attention)
  custom = al.MultiHeadDotProductAttention(num_heads=N, decode=True, attention_fn=nn.dot_product_attention)
  ours = layer("xla", N, decode=True)
  prompt, nxt, real = tokens(2, 4), tokens(2, 2, seed=2), [4, 2]
  _, cache = step(ours, params, new_cache(ours, 2, 8), prompt, lengths=jnp.array(real, jnp.int32))
  got = []
  for t in range(2):
    out, cache = step(custom, params, cache, nxt[:, t:t + 1])
    got.append(out)
  assert cache["cache_index"].tolist() == [6, 4]
  for b in range(2):
    alone = new_cache(flax, 1, 8)
    for t in range(real[b]):
      _, alone = step(flax, params, alone, prompt[b:b + 1, t:t + 1])
    for t in range(2):
      want, alone = step(flax, params, alone, nxt[b:b + 1, t:t + 1])
      reference.assert_close(got[t][b:b + 1], want, jnp.float32, what=f"row {b} step {t}")
