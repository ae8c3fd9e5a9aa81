"""The KV cache of attnlayers.nnx.MultiHeadAttention: chunked prefill and one position per sequence.

Flax's decode cache writes one token per call at one index shared by the whole batch, and
past its end `lax.dynamic_update_slice` clamps the index, so it silently overwrites the last
slot. Here each sequence has its own position (`cache_index` of shape (*batch,)); a call
writes T new tokens per row (`lengths[b]` of them real, right-padded) and its queries attend,
in one attention call, to the row's cache up to and including themselves (bottom-right
causal, see attnlayers.spec). Writing past the cache, or `lengths` outside [0, T], is an
error where the values are known (eager calls). Under jit nothing can raise, so such a row
does what a refused call does, row by row: its output for the call is NaN (attnlayers.attention
makes rows whose lengths fall outside [0, T] / [0, L] NaN) and its position stays where it was,
so its cache holds what it held and the next call that fits decodes as if this one had not run.
It never returns another position's values, and never clamps a count to make it fit.

A cache that Flax's own layer made (its linen `init`, its nnx `init_cache`) has one scalar
`cache_index` for the batch. The layers decode on it as it is: every row sits at that
position, every call advances all rows by its T, and the index stays a scalar of its dtype,
so the cache keeps its type from call to call (a `lax.scan` / `nn.scan` / `nnx.scan` carry
must). `lengths=` is refused there: rows of different lengths need one position each, which
the scalar cannot hold; a cache made by attnlayers' layers has them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_lengths(lengths, batch: tuple[int, ...], T: int):
  """The real new tokens per row, (*batch,) int32: default T; concrete values must lie in [0, T] (traced ones
  cannot be checked here: append keeps the position of a row whose count is out of range)."""
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


def check_dtype(dtype, source: str) -> None:
  """Raises unless `dtype` can hold keys and values (floating, or complex as complex attention needs): an integer
  or bool cache would truncate every projection silently. `source` says where the dtype came from."""
  if not jnp.issubdtype(jnp.dtype(dtype), jnp.inexact):
    raise ValueError(f"the KV cache holds keys and values, which need a floating dtype; got {jnp.dtype(dtype)} "
                     f"({source}). Give a float dtype, e.g. jnp.bfloat16 or jnp.float32")


SHOWN_ROWS = 8  # rows an overflow error lists; the rest it counts
# where a layer's cache gets its max_length, as an error names it: nnx's init_cache(input_shape, dtype) takes it in
# its shape, linen's init from the input it shapes the cache with
NNX_SIZE = "the max_length of init_cache's input_shape (*batch, max_length, in_features)"
LINEN_SIZE = "the max_length of the (*batch, max_length, features) input that init shapes the cache with"


def check_length(max_length: int, size: str = NNX_SIZE) -> None:
  """Raises for a cache of fewer than one position per row, where it is made: every decode call writes at least
  one token, so such a cache would refuse them all. `size` says where the length is given (NNX_SIZE, LINEN_SIZE)."""
  if max_length < 1:
    raise ValueError(f"a KV cache needs max_length >= 1 position per row; got {max_length} ({size}), and every "
                     "decode call would pass the end of such a cache. Give it the prompt's length plus the tokens "
                     "to generate (at least 1)")


def check_room(index, lengths, max_length: int, size: str = NNX_SIZE) -> None:
  """Raises where the positions are known and a row's real tokens would pass the cache's end, naming every such row
  (by its index in the batch dims), its position, what it adds, and the cache length that would hold them all;
  `size` says where that length is given (NNX_SIZE, LINEN_SIZE)."""
  if isinstance(index, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
    return  # under jit: the attention call makes those rows NaN
  index, lengths = np.asarray(index), np.asarray(lengths)
  end = index + lengths
  over = [tuple(int(i) for i in row) for row in np.argwhere(end > max_length)]  # (*batch,) indices, in order
  if not over:
    return
  name = lambda row: str(row[0]) if len(row) == 1 else f"({', '.join(map(str, row))})"
  unit = lambda n, first: (" token" if n == 1 else " tokens") if first else ""  # said once, after the first count
  rows = [f"row {name(r)} at position {int(index[r])} adds {int(lengths[r])}{unit(int(lengths[r]), not i)} "
          f"(to {int(end[r])})" for i, r in enumerate(over[:SHOWN_ROWS])]
  more = f" and {len(over) - SHOWN_ROWS} more rows" if len(over) > SHOWN_ROWS else ""
  raise ValueError(f"decoding past the KV cache: {', '.join(rows)}{more}; the cache holds {max_length} positions per "
                   f"row. Give it at least {int(end.max())} positions ({size}) or stop earlier.")


def check_flax_room(index, batch: tuple[int, ...], max_length: int, size: str = NNX_SIZE) -> None:
  """check_room for a cache in Flax's layout, written one token per call at one scalar `index` shared by the
  `batch` rows (a custom attention_fn's path on either layer): Flax's write clamps an index past the end and
  overwrites the last slot, so where the index is known this raises first."""
  check_room(jnp.broadcast_to(index, batch), jnp.ones(batch, jnp.int32), max_length, size)


def append(cached_key, cached_value, index, key, value, lengths, size: str = NNX_SIZE):
  """The cache after this call's tokens, and the attention arguments that read it (nnx and linen share this).

  cached_key / cached_value: (*batch, L, K, H); index: each row's next position, (*batch,), or a
  scalar shared by the rows (Flax's cache); key / value: (*batch, T, K, H), the call's new tokens;
  lengths: (*batch,) how many of the T are real (None: all; refused with a shared scalar index); size: where the
  cache's length is set, for the overflow error (check_room).
  Returns (keys (*batch, L, K, H), values, the index advanced, in its own shape and dtype, attention
  keyword arguments: bottom-right causal, the rows' query and key lengths).
  """
  *batch, max_length, num_kv_heads, head_dim = cached_key.shape
  batch, T = tuple(batch), key.shape[-3]
  if key.shape != (*batch, T, num_kv_heads, head_dim) or value.shape != key.shape:
    raise ValueError(f"Autoregressive cache shape error: the cache is (*batch, max_length, K, H) = "
                     f"{tuple(cached_key.shape)}, so this call's keys and values must be "
                     f"{(*batch, T, num_kv_heads, head_dim)}; got {tuple(key.shape)} and {tuple(value.shape)}")
  check_dtype(cached_key.dtype, "the cache's cached_key")
  if T == 0:  # attention over no queries is refused everywhere else (attnlayers.attention, the layers' forward)
    raise ValueError(f"a decode call needs T >= 1 new tokens per row; got keys of shape {tuple(key.shape)} (T = 0). "
                     "To leave a row where it is, give it lengths=0 in a call with T >= 1")
  index = jnp.asarray(index)
  shared = check_index(index, batch, lengths)
  lengths = check_lengths(lengths, batch, T)  # (*batch,)
  rows = jnp.broadcast_to(index, batch).astype(jnp.int32)  # (*batch,)
  check_room(rows, lengths, max_length, size)
  flat = lambda x: x.reshape((-1, *x.shape[len(batch):]))  # (*batch, ...) -> (B, ...)
  new_k, new_v = (write(flat(c), flat(x), rows.reshape(-1)).reshape(c.shape)
                  for c, x in ((cached_key, key), (cached_value, value)))
  ends = rows + lengths  # (*batch,)
  fits = (lengths >= 0) & (lengths <= T) & (ends <= max_length)  # (*batch,): all True where check_* could look
  # a row that does not fit keeps its position (its attention row is NaN); its writes land past it, where no call reads
  advanced = jnp.where(fits.all(), index + T, index) if shared else jnp.where(fits, ends, rows)  # () or (*batch,)
  return new_k, new_v, advanced.astype(index.dtype), cached_attention(lengths, ends)


def check_index(index, batch: tuple[int, ...], lengths) -> bool:
  """Whether `index` is one scalar shared by a batch of rows (Flax's cache); raises for any shape but
  () and (*batch,), and for lengths= with a shared index, whose rows cannot take different counts."""
  if not jnp.issubdtype(index.dtype, jnp.integer):  # a float position would be truncated where it is cast
    raise ValueError(f"cache_index must hold integer positions; got {index.dtype}")
  if index.shape not in ((), batch):
    raise ValueError(f"cache_index must have shape {batch} (one position per row, as attnlayers' layers make it) "
                     f"or () (one for the batch, as Flax's do); got shape {tuple(index.shape)}")
  shared = index.shape == () and batch != ()
  if shared and lengths is not None:
    raise ValueError(f"lengths= needs one position per row, but this cache's cache_index is one scalar for its "
                     f"{batch} rows (the layout of a cache made by Flax's own layer), which every row advances by "
                     f"the same count. Make the cache with attnlayers' layer (linen: its init with decode=True; nnx: "
                     f"its init_cache) for a cache_index of shape {batch}, or leave lengths= out")
  return shared


def cached_attention(query_lengths, key_lengths) -> dict:
  """The attention keyword arguments of a call on the cache: each row's new tokens (query_lengths, (*batch,))
  attend causally, aligned bottom-right, to its cached keys up to them (key_lengths, (*batch,))."""
  return dict(is_causal=True, causal_alignment="bottom-right", query_seq_lengths=query_lengths,
              key_value_seq_lengths=key_lengths)


def write(cache, new, index):
  """cache (B, L, K, H) with new (B, T, K, H) at positions index[b] + t; positions >= L are dropped."""
  T = new.shape[1]
  rows = jnp.arange(cache.shape[0])[:, None]  # (B, 1)
  cols = index[:, None] + jnp.arange(T, dtype=index.dtype)[None, :]  # (B, T)
  return cache.at[rows, cols].set(new.astype(cache.dtype), mode="drop")
