"""attnlayers.kv_cache: the shapes of cache_index it takes, and its overflow error: every row that would pass
the cache's end, as plain ints, with its position and what it adds, and the cache length that would hold them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlayers import kv_cache


def test_an_overflow_names_every_row_its_position_and_the_length_that_would_hold_it():
  index, lengths = np.array([4, 5, 1, 6], np.int32), np.array([3, 2, 3, 1], np.int32)  # rows 0, 1 and 3 pass 6
  with pytest.raises(ValueError) as e:
    kv_cache.check_room(index, lengths, 6)
  message = str(e.value)
  assert message == ("decoding past the KV cache: row 0 at position 4 adds 3 tokens (to 7), row 1 at position 5 adds 2 "
                     "(to 7), row 3 at position 6 adds 1 (to 7); the cache holds 6 positions per row. Give it at "
                     "least 7 positions (the max_length of init_cache's input_shape (*batch, max_length, in_features)) "
                     "or stop earlier."), message


def test_an_overflow_in_a_batch_of_two_dims_names_rows_by_both_indices():
  index = np.array([[0, 5], [2, 6]], np.int32)  # (*batch,) = (2, 2)
  with pytest.raises(ValueError) as e:
    kv_cache.check_room(index, np.full((2, 2), 2, np.int32), 6)
  assert "cache: row (0, 1) at position 5 adds 2 tokens (to 7), row (1, 1) at position 6 adds 2 (to 8); the cache " \
         "holds 6 positions per row. Give it at least 8 " in str(e.value), str(e.value)


def test_a_long_list_of_rows_is_cut_and_counted():
  with pytest.raises(ValueError) as e:
    kv_cache.check_room(np.full((20,), 6, np.int32), np.ones((20,), np.int32), 6)
  message = str(e.value)
  assert "row 7 at position 6 adds 1 (to 7) and 12 more rows; the cache holds" in message, message
  assert "row 8 " not in message


def test_rows_that_fit_raise_nothing():
  kv_cache.check_room(np.array([4, 2]), np.array([2, 4]), 6)


def test_an_index_neither_scalar_nor_one_per_row_is_refused():
  """cache_index is () (Flax's cache) or (*batch,) (ours); a (1,) index broadcast over a batch of 2 before."""
  cache, new = jnp.zeros((2, 6, 1, 8)), jnp.zeros((2, 1, 1, 8))
  with pytest.raises(ValueError, match=r"cache_index must have shape \(2,\) .* or \(\) .*got shape \(1,\)"):
    kv_cache.append(cache, cache, jnp.zeros((1,), jnp.int32), new, new, None)


def test_a_cache_index_that_is_not_integer_is_refused():
  """A float index was accepted and truncated where it was cast to a position."""
  cache, new = jnp.zeros((2, 6, 1, 8)), jnp.zeros((2, 1, 1, 8))
  with pytest.raises(ValueError, match="cache_index must hold integer positions; got float32"):
    kv_cache.append(cache, cache, jnp.full((2,), 1.5), new, new, None)


def test_under_jit_a_shared_index_that_would_pass_the_end_stays_put():
  """Flax's cache (one scalar cache_index) at 5 of 6, 2 more tokens under jit: nothing can raise, so the index stays
  at 5 (as an eager refusal leaves it; the attention rows are NaN) rather than moving past the end for good."""
  cache, new = jnp.zeros((2, 6, 1, 8)), jnp.ones((2, 2, 1, 8))
  index = jax.jit(lambda i: kv_cache.append(cache, cache, i, new, new, None)[2])(jnp.array(5, jnp.int32))
  assert index.shape == () and int(index) == 5, index


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.bool_], ids=["int8", "int32", "bool"])
def test_a_cache_that_is_not_floating_is_refused(dtype):
  """An integer or bool cache (given to the layer's state, as linen's variables or nnx.update can) truncated every
  key and value it stored, without a word; float and complex caches decode."""
  cache, new = jnp.zeros((2, 6, 1, 8), dtype), jnp.ones((2, 1, 1, 8))
  with pytest.raises(ValueError, match=rf"need a floating dtype; got {jnp.dtype(dtype)} \(the cache's cached_key\)"
                                       r"\. Give a float dtype, e.g\. jnp\.bfloat16"):
    kv_cache.append(cache, cache, jnp.zeros((2,), jnp.int32), new, new, None)
  for ok in (jnp.bfloat16, jnp.complex64):
    kv_cache.append(cache.astype(ok), cache.astype(ok), jnp.zeros((2,), jnp.int32), new, new, None)


def test_a_call_with_no_new_tokens_is_refused_by_name():
  """T = 0 raised ZeroDivisionError ("integer modulo by zero", reshaping the empty keys); attention over no queries
  is refused elsewhere too, and lengths=0 is the way to leave a row unchanged."""
  cache, new = jnp.zeros((2, 6, 1, 8)), jnp.zeros((2, 0, 1, 8))
  with pytest.raises(ValueError, match=r"T >= 1 new tokens per row; got keys of shape \(2, 0, 1, 8\) \(T = 0\)\. "
                                       r"To leave a row where it is, give it lengths=0"):
    kv_cache.append(cache, cache, jnp.zeros((2,), jnp.int32), new, new, None)
