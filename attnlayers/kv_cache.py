"""The KV cache of attnlayers.nnx.MultiHeadAttention: chunked prefill and one position per sequence.

Flax's decode cache writes one token per call at one index shared by the whole batch, and
past its end `lax.dynamic_update_slice` clamps the index, so it silently overwrites the last
slot. Here each sequence has its own position (`cache_index` of shape (*batch,)); a call
writes T new tokens per row (`lengths[b]` of them real, right-padded) and its queries attend,
in one attention call, to the row's cache up to and including themselves (bottom-right
causal, see attnlayers.spec). Writing past the cache is an error where the positions are
known (eager calls) and gives NaN rows under jit (attnlayers.attention makes rows whose
key length exceeds the cache NaN); it never returns another position's values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_lengths(lengths, batch: tuple[int, ...], T: int):
  """The real new tokens per row, (*batch,) int32: default T; concrete values must lie in [1, T]... or 0."""
  if lengths is None:
    return jnp.full(batch, T, jnp.int32)
  if not hasattr(lengths, "shape") or not jnp.issubdtype(jnp.asarray(lengths).dtype, jnp.integer):
    raise ValueError(f"lengths must be an integer array of shape {batch} (real new tokens per sequence); got {lengths!r}")
  lengths = jnp.asarray(lengths)
  if lengths.shape != batch:
    raise ValueError(f"lengths must have shape {batch}, one count per sequence; got shape {lengths.shape}")
  if not isinstance(lengths, jax.core.Tracer):
    values = np.asarray(lengths)
    if values.min() < 0 or values.max() > T:
      raise ValueError(f"lengths must lie in [0, T={T}] (the new tokens of this call, right-padded); got {values.tolist()}")
  return lengths.astype(jnp.int32)


def check_room(index, lengths, max_length: int) -> None:
  """Raises where the positions are known and a row's real tokens would pass the cache's end."""
  if isinstance(index, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
    return  # under jit: the attention call makes those rows NaN
  end = np.asarray(index) + np.asarray(lengths)
  over = np.argwhere(end > max_length)
  if over.size:
    row = tuple(int(i) for i in over[0])
    raise ValueError(f"decoding past the KV cache: sequence {row} is at position {int(np.asarray(index)[row])} and "
                     f"this call adds {int(np.asarray(lengths)[row])} tokens, but the cache holds {max_length}. "
                     "Make the cache longer (init_cache with a larger length) or stop earlier.")


def write(cache, new, index):
  """cache (B, L, K, H) with new (B, T, K, H) at positions index[b] + t; positions >= L are dropped."""
  T = new.shape[1]
  rows = jnp.arange(cache.shape[0])[:, None]  # (B, 1)
  cols = index[:, None] + jnp.arange(T, dtype=index.dtype)[None, :]  # (B, T)
  return cache.at[rows, cols].set(new.astype(cache.dtype), mode="drop")
