"""Per-row lengths and causal alignment as the keys each query may attend, shared by the backends.

The rule (attnlayers.spec): query (b, t) may attend key s iff t < Tb, s < Sb, the causal rule
(s <= t top-left, s <= t + Sb - Tb bottom-right) and the caller's mask. A query that is padding
(t >= Tb) or that lengths and causality leave without a key outputs exactly 0, on every
backend (`finish`), with zero gradients. Lengths outside [0, T] / [0, S] that were traced (so
spec.describe could not reject them) make their row NaN rather than silently wrong.
"""

from __future__ import annotations

import jax.numpy as jnp

from attnlayers.spec import Options


def lengths(opts: Options, B: int, T: int, S: int):
  """(Tb (B,), Sb (B,)) int32, defaulting to T and S."""
  q = jnp.full((B,), T, jnp.int32) if opts.query_seq_lengths is None else jnp.asarray(opts.query_seq_lengths, jnp.int32)
  kv = jnp.full((B,), S, jnp.int32) if opts.key_value_seq_lengths is None else jnp.asarray(opts.key_value_seq_lengths, jnp.int32)
  return q, kv


def bottom_right(opts: Options, T: int, S: int) -> bool:
  """Causal with the queries at the end of the keys, where that differs from top-left (spec.Call.bottom_right)."""
  return opts.is_causal and opts.causal_alignment == "bottom-right" and (T != S or opts.has_lengths)


def plain(opts: Options, T: int, S: int) -> bool:
  """No lengths and no bottom-right causality: the call every backend ran before lengths existed."""
  return not opts.has_lengths and not bottom_right(opts, T, S)


def structural(opts: Options, B: int, T: int, S: int):
  """Bool (B|1, 1, T, S): what lengths and causality allow (not the caller's mask); None if everything."""
  t = jnp.arange(T, dtype=jnp.int32)[:, None]  # (T, 1)
  s = jnp.arange(S, dtype=jnp.int32)[None, :]  # (1, S)
  if plain(opts, T, S):
    return jnp.tril(jnp.ones((T, S), jnp.bool_))[None, None] if opts.is_causal else None
  q_len, kv_len = (x[:, None, None, None] for x in lengths(opts, B, T, S))  # (B, 1, 1, 1)
  keep = (t < q_len) & (s < kv_len)  # (B, 1, T, S)
  if opts.is_causal:
    keep &= s <= (t + kv_len - q_len if bottom_right(opts, T, S) else t)
  return keep


def allowed(opts: Options, B: int, T: int, S: int):
  """Bool broadcastable to (B, N, T, S): structural() and the caller's mask; None if everything."""
  keep = structural(opts, B, T, S)
  if opts.mask is None:
    return keep
  mask = opts.mask.reshape((1,) * (4 - opts.mask.ndim) + opts.mask.shape)
  return mask if keep is None else keep & mask


def rows(opts: Options, B: int, T: int, S: int):
  """Bool (B, T): queries that are real and have a key by lengths and causality; None if all do."""
  if plain(opts, T, S):
    return None  # top-left causal leaves every query key 0
  q_len, kv_len = (x[:, None] for x in lengths(opts, B, T, S))  # (B, 1)
  t = jnp.arange(T, dtype=jnp.int32)[None, :]  # (1, T)
  valid = (t < q_len) & (kv_len > 0)  # key 0 is real and, top-left, visible to every query
  if bottom_right(opts, T, S):
    valid &= t + kv_len - q_len >= 0  # the newest key a query sees is key 0 or later
  return valid  # (B, T)


def finish(out, opts: Options, S: int):
  """out (B, T, N, H) with the rule's zero rows, and NaN rows for traced lengths out of range."""
  B, T = out.shape[:2]
  valid = rows(opts, B, T, S)
  if valid is None:
    return out
  out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
  q_len, kv_len = lengths(opts, B, T, S)
  in_range = (q_len >= 0) & (q_len <= T) & (kv_len >= 0) & (kv_len <= S)  # (B,)
  return jnp.where(in_range[:, None, None, None], out, jnp.full((), jnp.nan, out.dtype))
