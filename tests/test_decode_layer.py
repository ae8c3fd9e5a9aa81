"""Decoding with attnlayers.nnx.MultiHeadAttention's KV cache (issue 11, the layer), on a CPU.

One-token steps against Flax's own class, chunked prefill against the full causal forward,
a ragged batch against its rows decoded alone, the cache's shape and dtype, and what decoding
past the cache does (an error eagerly, NaN rows under jit; Flax's class clamps its write
index there and returns another position's values without a word).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnlayers.nnx import MultiHeadAttention
from tests import reference

N, D = 4, 32  # query heads, model width: head dim 8
KV_HEADS = {"MHA": 4, "GQA": 2, "MQA": 1}
BACKENDS = ["naive", "xla", "auto"]


def layer(backend, kv_heads, **kwargs):
  """A causal layer; the same parameters on every call (rngs seed 0)."""
  return MultiHeadAttention(N, D, num_kv_heads=kv_heads, decode=False, backend=backend, is_causal=True,
                            rngs=nnx.Rngs(0), **kwargs)


def tokens(*shape, seed=1):
  return jax.random.normal(jax.random.key(seed), (*shape, D))


def flax_twin(ours, kv_heads):
  """Flax's own class holding our layer's parameters (copied, so a different init cannot pass for equality)."""
  flax = nnx.MultiHeadAttention(N, D, num_kv_heads=kv_heads, decode=False, rngs=nnx.Rngs(7))
  nnx.update(flax, nnx.state(ours, nnx.Param))
  return flax


@pytest.mark.parametrize("heads", list(KV_HEADS))
@pytest.mark.parametrize("backend", ["xla", "auto"])
def test_one_token_decode_is_flax_bit_for_bit(backend, heads):
  """Steps 0..4 into a cache of 8 (so unwritten slots must be masked): outputs and caches equal Flax's bits."""
  ours = layer(backend, KV_HEADS[heads])
  flax = flax_twin(ours, KV_HEADS[heads])
  x = tokens(2, 8)
  ours.init_cache(x.shape, dtype=jnp.float32)
  flax.init_cache(x.shape, dtype=jnp.float32)
  for t in range(5):
    np.testing.assert_array_equal(ours(x[:, t:t + 1], decode=True), flax(x[:, t:t + 1], decode=True),
                                  err_msg=f"{backend} {heads} step {t}")
  for name in ("cached_key", "cached_value"):
    np.testing.assert_array_equal(getattr(ours, name)[...], getattr(flax, name)[...], err_msg=name)
  np.testing.assert_array_equal(ours.cache_index[...], [5, 5])
  assert int(flax.cache_index[...]) == 5


@pytest.mark.parametrize("heads", list(KV_HEADS))
def test_one_token_decode_naive_matches_flax(heads):
  """naive is not Flax's kernel (its float32 score einsum groups heads differently, off by an ulp
  even without a cache), so against Flax it is held to the float32 tolerance; the caches are
  the projections' own bits."""
  ours = layer("naive", KV_HEADS[heads])
  flax = flax_twin(ours, KV_HEADS[heads])
  x = tokens(2, 8)
  ours.init_cache(x.shape, dtype=jnp.float32)
  flax.init_cache(x.shape, dtype=jnp.float32)
  for t in range(5):
    reference.assert_close(ours(x[:, t:t + 1], decode=True), flax(x[:, t:t + 1], decode=True), jnp.float32,
                           what=f"naive {heads} step {t}")
  for name in ("cached_key", "cached_value"):
    np.testing.assert_array_equal(getattr(ours, name)[...], getattr(flax, name)[...], err_msg=name)


@pytest.mark.parametrize("heads", list(KV_HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_then_steps_equal_the_causal_forward(backend, heads):
  """Chunks of 5 and 4 tokens, then 3 one-token steps, into a cache of 16: the full causal forward's numbers."""
  m = layer(backend, KV_HEADS[heads])
  x = tokens(2, 12)
  full = m(x, decode=False, is_causal=True)
  m.init_cache((2, 16, D))
  parts = [m(x[:, :5], decode=True), m(x[:, 5:9], decode=True)]
  parts += [m(x[:, t:t + 1], decode=True) for t in range(9, 12)]
  reference.assert_close(jnp.concatenate(parts, axis=1), full, jnp.float32, what=f"{backend} {heads} decode vs full")
  np.testing.assert_array_equal(m.cache_index[...], [12, 12])


@pytest.mark.parametrize("heads", list(KV_HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_equals_each_row_decoded_alone(backend, heads):
  """A right-padded prompt chunk (5 tokens, 5/2/3 real), two steps, then a chunk of 3 with 1/3/0 real.

  The batch decodes under nnx.jit (traced positions and lengths, as a decode loop runs), each
  row alone eagerly with only its real tokens. Real positions agree, padding ones are finite.
  """
  kv_heads = KV_HEADS[heads]
  prompt, steps, chunk = tokens(3, 5, seed=1), [tokens(3, 1, seed=2), tokens(3, 1, seed=3)], tokens(3, 3, seed=4)
  prompt_len, chunk_len = [5, 2, 3], [1, 3, 0]
  batch = layer(backend, kv_heads)
  batch.init_cache((3, 16, D))
  decode = nnx.jit(lambda m, x, lengths: m(x, decode=True, lengths=lengths))
  outs = [decode(batch, prompt, jnp.array(prompt_len, jnp.int32))]
  outs += [decode(batch, x, jnp.ones(3, jnp.int32)) for x in steps]
  outs.append(decode(batch, chunk, jnp.array(chunk_len, jnp.int32)))
  for out in outs:
    assert np.isfinite(np.asarray(out)).all(), "outputs at padding positions must be finite"
  np.testing.assert_array_equal(batch.cache_index[...], np.add(prompt_len, 2) + chunk_len)
  for b in range(3):
    alone = layer(backend, kv_heads)
    alone.init_cache((1, 16, D))
    row = lambda x, n: x[b:b + 1, :n]  # (1, n, D): the row's real tokens only
    want = [alone(row(prompt, prompt_len[b]), decode=True)] + [alone(row(x, 1), decode=True) for x in steps]
    got = [outs[0][b:b + 1, :prompt_len[b]], outs[1][b:b + 1], outs[2][b:b + 1]]
    if chunk_len[b]:
      want.append(alone(row(chunk, chunk_len[b]), decode=True))
      got.append(outs[3][b:b + 1, :chunk_len[b]])
    for i, (g, w) in enumerate(zip(got, want)):
      reference.assert_close(g, w, jnp.float32, what=f"{backend} {heads} row {b} call {i}")
    end = int(alone.cache_index[0])
    assert int(batch.cache_index[b]) == end
    for name in ("cached_key", "cached_value"):
      reference.assert_close(getattr(batch, name)[b, :end], getattr(alone, name)[0, :end], jnp.float32,
                             what=f"{name} row {b}")


@pytest.mark.parametrize("dtype, param_dtype, want", [(None, jnp.float32, jnp.float32),
                                                      (jnp.bfloat16, jnp.float32, jnp.bfloat16),
                                                      (None, jnp.bfloat16, jnp.float32)],
                         ids=["float32", "bf16-compute", "bf16-params"])
def test_cache_holds_kv_heads_in_the_compute_dtype(dtype, param_dtype, want):
  m = MultiHeadAttention(N, D, num_kv_heads=2, decode=False, backend="xla", dtype=dtype, param_dtype=param_dtype,
                         rngs=nnx.Rngs(0))
  m.init_cache((3, 2, 16, D))  # two batch dims
  for name in ("cached_key", "cached_value"):
    cache = getattr(m, name)[...]
    assert cache.shape == (3, 2, 16, 2, D // N) and cache.dtype == want, (name, cache.shape, cache.dtype)
  index = m.cache_index[...]
  assert index.shape == (3, 2) and index.dtype == jnp.int32 and not index.any()
  y = m(tokens(3, 2, 4).astype(want), decode=True)
  assert y.shape == (3, 2, 4, D)
  np.testing.assert_array_equal(m.cache_index[...], np.full((3, 2), 4))
  m.init_cache((3, 2, 16, D), dtype=jnp.float32)  # an explicit dtype wins
  assert m.cached_key[...].dtype == m.cached_value[...].dtype == jnp.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_call_with_no_tokens_is_refused_and_writes_nothing(backend):
  m = layer(backend, 2)
  m.init_cache((2, 6, D))
  with pytest.raises(ValueError, match=r"a decode call needs T >= 1 new tokens per row"):
    m(tokens(2, 0), decode=True)
  np.testing.assert_array_equal(m.cache_index[...], [0, 0])


def test_init_cache_refuses_a_dtype_that_is_not_floating():
  """int8 / int32 / bool caches were made, and truncated every key and value written to them."""
  for dtype in (jnp.int8, jnp.int32, jnp.bool_):
    with pytest.raises(ValueError, match=rf"got {jnp.dtype(dtype)} \(init_cache's dtype=\)\. Give a float dtype"):
      layer("xla", 2).init_cache((2, 6, D), dtype=dtype)
  with pytest.raises(ValueError, match=r"got int32 \(the layer's dtype=, init_cache's default\)"):
    layer("xla", 2, dtype=jnp.int32).init_cache((2, 6, D))


def test_bf16_params_without_a_dtype_cache_float32_as_flax_does():
  """dtype=None, param_dtype=bfloat16: float32 inputs give float32 keys, and Flax's init_cache holds them in
  float32; the cache was bfloat16 (the param_dtype), so it rounded every key and value Flax keeps."""
  ours = layer("xla", N, param_dtype=jnp.bfloat16)
  flax = nnx.MultiHeadAttention(N, D, decode=False, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(7))
  nnx.update(flax, nnx.state(ours, nnx.Param))
  x = tokens(2, 4)
  ours.init_cache(x.shape)
  flax.init_cache(x.shape)
  for t in range(3):
    np.testing.assert_array_equal(ours(x[:, t:t + 1], decode=True), flax(x[:, t:t + 1], decode=True), f"step {t}")
  for name in ("cached_key", "cached_value"):
    np.testing.assert_array_equal(getattr(ours, name)[...], getattr(flax, name)[...], err_msg=name)


def _names(message: str, *numbers) -> bool:
  return all(re.search(rf"(?<!\d){n}(?!\d)", message) for n in numbers)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_past_the_cache_raises_and_leaves_it_unchanged(backend):
  """Cache of 6 at position 4: 3 more tokens raise, naming 4, 3 and 6; a refused call writes nothing."""
  m = layer(backend, 2)
  m.init_cache((2, 6, D))
  m(tokens(2, 4), decode=True)
  before = {name: np.asarray(getattr(m, name)[...]) for name in ("cached_key", "cached_value", "cache_index")}
  with pytest.raises(ValueError) as error:
    m(tokens(2, 3, seed=2), decode=True)
  assert _names(str(error.value), 4, 3, 6), str(error.value)
  with pytest.raises(ValueError) as error:  # only row 1's real tokens overflow
    m(tokens(2, 3, seed=2), decode=True, lengths=jnp.array([2, 3], jnp.int32))
  assert _names(str(error.value), 4, 3, 6), str(error.value)
  for name, value in before.items():
    np.testing.assert_array_equal(getattr(m, name)[...], value, err_msg=f"{name} changed by a refused call")


def test_a_call_refused_after_the_projections_leaves_the_cache_unchanged():
  """Refusals raised once the new keys are known (dropout with no `deterministic`, a mask that does not fit the
  cache's (B, N, T, S) = (2, 4, 1, 6)) came after the cache write: the refused call had advanced cache_index and
  written its keys."""
  for kwargs, call in (({"dropout_rate": 0.1}, {}), ({}, {"mask": jnp.ones((2, 1, 1, 5), bool)})):
    m = layer("xla", 2, **kwargs)
    m.init_cache((2, 6, D))
    m(tokens(2, 2), decode=True, **({"deterministic": True} if kwargs else {}))
    before = {name: np.asarray(getattr(m, name)[...]) for name in ("cached_key", "cached_value", "cache_index")}
    with pytest.raises(ValueError):
      m(tokens(2, 1, seed=2), decode=True, **call)
    for name, value in before.items():
      np.testing.assert_array_equal(getattr(m, name)[...], value, err_msg=f"{name} changed by a refused call {call}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_past_the_cache_end_is_not_an_overflow(backend):
  """Cache of 6 at position 4, a chunk of 3 with 2 real tokens: the padding slot falls off the end, harmlessly."""
  m = layer(backend, 2)
  x = tokens(2, 6)
  full = m(x, decode=False, is_causal=True)
  m.init_cache((2, 6, D))
  head = m(x[:, :4], decode=True)
  tail = m(jnp.concatenate([x[:, 4:], tokens(2, 1, seed=9)], axis=1), decode=True, lengths=jnp.array([2, 2], jnp.int32))
  reference.assert_close(jnp.concatenate([head, tail[:, :2]], axis=1), full, jnp.float32, what=f"{backend} to the end")
  np.testing.assert_array_equal(m.cache_index[...], [6, 6])


def prefilled_under_jit(backend, max_length):
  """A GQA layer with a cache of max_length, its decode call under nnx.jit, tokens x (2, max_length, D) and their
  full causal forward; x's first 4 tokens are prefilled through the jitted call. Returns (m, decode, x, full)."""
  decode = nnx.jit(lambda m, x, lengths: m(x, decode=True, lengths=lengths))
  m = layer(backend, 2)
  x = tokens(2, max_length)
  full = m(x, decode=False, is_causal=True)
  m.init_cache((2, max_length, D))
  decode(m, x[:, :4], jnp.array([4, 4], jnp.int32))
  return m, decode, x, full


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_past_the_cache_under_jit_gives_nan_rows(backend):
  """Under nnx.jit positions are traced, so nothing can raise: the overflowing row is NaN, the other row is right."""
  m, decode, x, full = prefilled_under_jit(backend, 6)
  out = np.asarray(decode(m, jnp.concatenate([x[:, 4:], tokens(2, 1, seed=9)], axis=1), jnp.array([2, 3], jnp.int32)))
  assert np.isnan(out[1]).all(), "row 1 writes 3 tokens at position 4 of a cache of 6"
  assert np.isfinite(out[0]).all()
  reference.assert_close(out[0, :2], full[0, 4:], jnp.float32, what=f"{backend} row 0 beside an overflowing row")


def test_the_full_cache_of_docs_layers_md():
  """docs/layers.md's example, as written there: a row at position 4 of a 4-position cache that a jitted call gives
  one more token returns NaN and keeps cache_index 4; the same call eagerly raises, naming where the cache's length
  is given (init_cache's input_shape: init_cache has no max_length argument, which the error named)."""
  m = layer("xla", 2)
  m.init_cache((1, 4, D))
  m(tokens(1, 4), decode=True)
  out = nnx.jit(lambda m, x: m(x, decode=True))(m, tokens(1, 1, seed=9))
  assert np.isnan(np.asarray(out)).all()
  np.testing.assert_array_equal(m.cache_index[...], [4])
  with pytest.raises(ValueError, match=re.escape(
      "row 0 at position 4 adds 1 token (to 5); the cache holds 4 positions per row. Give it at least 5 positions "
      "(the max_length of init_cache's input_shape (*batch, max_length, in_features)) or stop earlier.")):
    m(tokens(1, 1, seed=9), decode=True)
  np.testing.assert_array_equal(m.cache_index[...], [4])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_refused_under_jit_is_nan_once_and_keeps_its_cache(backend):
  """Under nnx.jit a row with lengths outside [0, T] (7 or -2 of T = 2), or past the cache's end (5 at 4 of 8), cannot
  raise:
  its output for that call is NaN and its position stays put, so its next call decodes as if the refused one had
  not run (before, its cache_index moved by the bad count, to 10 or backwards, and later calls read slots never
  written or overwrote real ones, with finite outputs)."""
  m, decode, x, full = prefilled_under_jit(backend, 8)
  for T, fine, bad in ((2, 2, 7), (2, 2, -2), (5, 1, 5)):  # 5 real tokens fit T = 5 but not the 4 free slots
    out = np.asarray(decode(m, tokens(2, T, seed=9), jnp.array([fine, bad], jnp.int32)))
    assert np.isnan(out[1]).all() and np.isfinite(out[0]).all(), f"T={T}, lengths [{fine}, {bad}]"
    np.testing.assert_array_equal(m.cache_index[...], [4 + fine, 4], err_msg=f"T={T}, lengths [{fine}, {bad}]")
    m.cache_index[...] = jnp.array([4, 4], jnp.int32)  # row 0 back to 4 too: both go on from the prefill
  out = decode(m, x[:, 4:], jnp.array([4, 4], jnp.int32))
  reference.assert_close(out, full[:, 4:], jnp.float32, what=f"{backend} after three refused rows")


@pytest.mark.parametrize("jit", [False, True])
def test_a_cache_flax_made_decodes_and_keeps_its_scalar_index(jit):
  """A cache from Flax's own init_cache (or its state nnx.update'd in) has one scalar cache_index for the batch.
  kv_cache.append reads it as every row's position and returns it a scalar, advanced by each call's T. It
  raised a bare broadcast error ("Cannot broadcast to shape with fewer dimensions"), writing (B,) into the
  scalar in place; then it kept (B,), so the layer's state changed type after its first call."""
  ours = layer("xla", 2)
  flax = flax_twin(ours, 2)
  x = tokens(2, 6)
  flax.init_cache(x.shape)
  ours.init_cache(x.shape, dtype=jnp.float32)
  nnx.update(ours, nnx.state(flax, nnx.Cache))  # Flax's cache: cache_index of shape ()
  assert ours.cache_index[...].shape == ()
  step = nnx.jit(lambda m, x: m(x, decode=True)) if jit else (lambda m, x: m(x, decode=True))
  for t in range(3):
    np.testing.assert_array_equal(step(ours, x[:, t:t + 1]), flax(x[:, t:t + 1], decode=True), err_msg=f"step {t}")
  index = ours.cache_index[...]
  assert (index.shape, index.dtype) == ((), jnp.int32), (index.shape, index.dtype)
  np.testing.assert_array_equal(index, 3)


def scan_steps(m, x):
  """Decodes x (B, T, D) one token per step inside lax.scan over m's split state: (outputs (B, T, D), state)."""
  graphdef, state = nnx.split(m)
  def body(state, xt):  # xt (B, D)
    m = nnx.merge(graphdef, state)
    out = m(xt[:, None], decode=True)
    return nnx.state(m), out[:, 0]
  state, outs = jax.lax.scan(body, state, x.swapaxes(0, 1))  # outs (T, B, D)
  return outs.swapaxes(0, 1), state


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["F32", "BF16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_on_a_cache_flax_made_matches_flax_and_keeps_its_scalar_index(backend, dtype):
  """Our layer holding Flax's init_cache state (cache_index: one int32 scalar) and Flax's layer, each decoding
  the same tokens in lax.scan over its split state. The scan raised "carry input and carry output must have
  equal types": the index came back as (B,)."""
  ours = layer(backend, N, dtype=dtype)
  flax = nnx.MultiHeadAttention(N, D, decode=False, dtype=dtype, rngs=nnx.Rngs(7))
  nnx.update(flax, nnx.state(ours, nnx.Param))
  x = tokens(2, 6).astype(dtype)
  flax.init_cache(x.shape, dtype=dtype)
  ours.init_cache(x.shape)
  nnx.update(ours, nnx.state(flax, nnx.Cache))
  out_o, state_o = scan_steps(ours, x)
  out_f, state_f = scan_steps(flax, x)
  reference.assert_close(out_o.astype(jnp.float32), out_f.astype(jnp.float32), dtype, what=f"{backend} scan")
  index = state_o["cache_index"][...]
  assert (index.shape, index.dtype) == ((), jnp.int32), (index.shape, index.dtype)
  np.testing.assert_array_equal(index, 6)
  for name in ("cached_key", "cached_value"):
    np.testing.assert_array_equal(state_o[name][...], state_f[name][...], err_msg=name)


def test_lengths_on_a_cache_flax_made_is_refused():
  """A scalar cache_index cannot hold rows of different lengths; the error says where a per-row cache comes from
  (before, the call promoted the index to (B,) and so changed the layer's state type)."""
  ours = layer("xla", N)
  flax = flax_twin(ours, N)
  flax.init_cache((2, 8, D))
  ours.init_cache((2, 8, D))
  nnx.update(ours, nnx.state(flax, nnx.Cache))
  with pytest.raises(ValueError, match=r"lengths= needs one position per row.*\(2,\) rows.*nnx: its init_cache"):
    ours(tokens(2, 3), decode=True, lengths=jnp.array([3, 1], jnp.int32))
  assert ours.cache_index[...].shape == ()


def test_custom_attention_fn_decodes_on_flaxs_cache_as_flax_does():
  """A custom attention_fn decodes through Flax's own __call__, one token per call on Flax's cache (a scalar
  cache_index): init_cache makes that cache, and the steps equal Flax's class from the same rngs."""
  x = jax.random.normal(jax.random.key(1), (2, 6, 32))
  ours = MultiHeadAttention(4, 32, decode=True, attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0))
  flax = nnx.MultiHeadAttention(4, 32, decode=True, attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0))
  ours.init_cache(x.shape)
  flax.init_cache(x.shape)
  assert ours.cache_index.shape == flax.cache_index.shape == ()
  for t in range(x.shape[1]):
    np.testing.assert_array_equal(ours(x[:, t:t + 1]), flax(x[:, t:t + 1]))


def test_custom_attention_fn_past_flaxs_cache_raises_as_the_backends_do():
  """Flax's __call__ writes with dynamic_update_slice, which clamps an index past the end: a third token into a cache
  of 2 overwrote the last slot without a word. Eagerly it now raises in the backends' words."""
  m = MultiHeadAttention(N, D, decode=True, attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0))
  m.init_cache((2, 2, D))
  m(tokens(2, 1))
  m(tokens(2, 1))
  with pytest.raises(ValueError, match=r"row 0 at position 2 adds 1 token \(to 3\).*holds 2 positions per row\. "
                                       r"Give it at least 3 positions \(the max_length of init_cache's input_shape "
                                       r"\(\*batch, max_length, in_features\)\)"):
    m(tokens(2, 1))
  assert int(m.cache_index[...]) == 2


@pytest.mark.parametrize("attention_fn", [None, nnx.dot_product_attention], ids=["backend", "custom"])
def test_a_cache_of_length_0_is_refused_where_it_is_made(attention_fn):
  """init_cache((2, 0, D)) made a cache that every decode call then overflowed; it now raises at once, naming the
  length and what works."""
  m = MultiHeadAttention(N, D, decode=True, attention_fn=attention_fn, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"a KV cache needs max_length >= 1 position per row; got 0 \(the max_length "
                                       r"of init_cache's input_shape \(\*batch, max_length, in_features\)\)"):
    m.init_cache((2, 0, D))
  assert m.cached_key is None, "refused before a cache was made"


def test_custom_attention_fn_refuses_a_per_row_cache():
  """A cache with one position per row (the backend path's init_cache, nnx.update'd in) cannot decode through
  Flax's __call__, whose one index for the batch it writes with: the error says so and what works, where jax raised
  "start_indices arguments to dynamic_update_slice must be scalars" from inside Flax's code."""
  x = jax.random.normal(jax.random.key(1), (2, 6, 32))
  backend = MultiHeadAttention(4, 32, decode=True, rngs=nnx.Rngs(0))
  custom = MultiHeadAttention(4, 32, decode=True, attention_fn=nnx.dot_product_attention, rngs=nnx.Rngs(0))
  backend.init_cache(x.shape, dtype=jnp.float32)
  custom.init_cache(x.shape, dtype=jnp.float32)
  nnx.update(custom, nnx.state(backend, nnx.Cache))
  with pytest.raises(ValueError, match=r"one position per row \(cache_index shape \(2,\)\).*Flax's __call__.*"
                                       r"this layer's init_cache.*without attention_fn"):
    custom(x[:, :1])
  np.testing.assert_array_equal(custom.cache_index[...], [0, 0])  # refused before Flax's code wrote anything
