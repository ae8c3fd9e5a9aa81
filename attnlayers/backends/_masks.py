"""Lengths, causal alignment, segments and windows as the keys each query may attend, for every backend.

The rule (attnlayers.spec): query (b, t), at position p = t (or t + Sb - Tb bottom-right), may
attend key s iff t < Tb, s < Sb, s <= p if causal, its segment id equals the key's and is not 0,
p - left <= s <= p + right for a window, and the caller's mask. A query that is padding or that
this rule leaves without a key outputs exactly 0, on every backend (`finish`), with zero gradients. Lengths outside
[0, T] / [0, S] and negative segment ids that were traced (so spec.describe could not reject them) make their row
NaN rather than silently wrong.
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
  """No lengths, bottom-right causality, segments or window: the call every backend ran before they existed."""
  return not opts.has_lengths and not bottom_right(opts, T, S) and not opts.has_segments and opts.window is None


def _positions(opts: Options, B: int, T: int, S: int):
  """(t (1, T), p (B, T): each query's position against the keys, q_len (B, 1), kv_len (B, 1))."""
  q_len, kv_len = (x[:, None] for x in lengths(opts, B, T, S))  # (B, 1)
  t = jnp.arange(T, dtype=jnp.int32)[None, :]  # (1, T)
  p = t + (kv_len - q_len) if bottom_right(opts, T, S) else jnp.broadcast_to(t, (B, T))
  return t, p, q_len, kv_len


def _key_range(opts: Options, p, kv_len):
  """(lo, hi) (B, T): the keys s with lo <= s <= hi that lengths, causality and the window allow a query at p."""
  lo = jnp.zeros_like(p) if opts.window is None else jnp.maximum(p - opts.window[0], 0)
  hi = jnp.broadcast_to(kv_len - 1, p.shape)
  if opts.is_causal:
    hi = jnp.minimum(hi, p)
  if opts.window is not None:
    hi = jnp.minimum(hi, p + opts.window[1])
  return lo, hi


def structural(opts: Options, B: int, T: int, S: int):
  """Bool (B|1, 1, T, S): what lengths, causality, segments and the window allow (not the caller's mask);
  None if everything."""
  if plain(opts, T, S):
    return jnp.tril(jnp.ones((T, S), jnp.bool_))[None, None] if opts.is_causal else None
  t, p, q_len, _ = _positions(opts, B, T, S)
  lo, hi = _key_range(opts, p, lengths(opts, B, T, S)[1][:, None])  # (B, T)
  s = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # (1, 1, S)
  keep = (t < q_len)[:, :, None] & (s >= lo[:, :, None]) & (s <= hi[:, :, None])  # (B, T, S)
  if opts.has_segments:
    q_ids, kv_ids = segment_ids(opts)
    keep &= (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids != 0)[:, :, None]
  return keep[:, None]  # (B, 1, T, S)


def segment_ids(opts: Options):
  """(q (B, T), kv (B, S)) int32 segment ids."""
  return jnp.asarray(opts.q_segment_ids, jnp.int32), jnp.asarray(opts.kv_segment_ids, jnp.int32)


def allowed(opts: Options, B: int, T: int, S: int):
  """Bool broadcastable to (B, N, T, S): structural() and the caller's mask; None if everything."""
  keep = structural(opts, B, T, S)
  if opts.mask is None:
    return keep
  mask = opts.mask.reshape((1,) * (4 - opts.mask.ndim) + opts.mask.shape)
  return mask if keep is None else keep & mask


def rows(opts: Options, B: int, T: int, S: int):
  """Bool (B, T): queries that are real and have a key by lengths, causality, segments and the window;
  None if all do."""
  if plain(opts, T, S):
    return None  # top-left causal leaves every query key 0
  t, p, q_len, kv_len = _positions(opts, B, T, S)
  lo, hi = _key_range(opts, p, kv_len)  # (B, T)
  valid = (t < q_len) & (lo <= hi)
  if opts.shared_segments and not opts.has_lengths:  # T == S, p = t: the query's own key is in [lo, hi]
    valid &= segment_ids(opts)[0] != 0
  elif opts.has_segments:  # some key of the query's own document in [lo, hi] (a reduction XLA fuses)
    q_ids, kv_ids = segment_ids(opts)
    s = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # (1, 1, S)
    same = (q_ids[:, :, None] == kv_ids[:, None, :]) & (s >= lo[:, :, None]) & (s <= hi[:, :, None])
    valid &= (q_ids != 0) & jnp.any(same, axis=-1)
  return valid  # (B, T)


def finish(out, opts: Options, S: int):
  """out (B, T, N, H) with the rule's zero rows (also rows the caller's mask empties), and NaN rows for
  traced lengths out of range."""
  B, T = out.shape[:2]
  valid = rows(opts, B, T, S)
  if valid is not None:
    valid = valid[:, :, None, None]  # (B, T, 1, 1)
  if opts.mask is not None:  # a query the mask leaves no key the rule allows (or none at all): zeros too, not the
    # uniform average over every key, future ones included, that the kernels' softmax of equal scores gives
    keep = allowed(opts, B, T, S)  # (B|1, N|1, T|1, S|1): the rule and the mask together
    some = jnp.any(keep, axis=-1).transpose(0, 2, 1)[..., None]  # (B|1, T|1, N|1, 1)
    valid = some if valid is None else valid & some
  if valid is not None:
    out = jnp.where(valid, out, jnp.zeros((), out.dtype))
  in_range = jnp.ones((B,), jnp.bool_)  # rows whose traced lengths and ids spec.describe could not check
  if opts.has_lengths:
    q_len, kv_len = lengths(opts, B, T, S)
    in_range &= (q_len >= 0) & (q_len <= T) & (kv_len >= 0) & (kv_len <= S)  # (B,)
  if opts.has_segments:
    q_ids, kv_ids = segment_ids(opts)
    in_range &= (jnp.min(q_ids, axis=1) >= 0) & (jnp.min(kv_ids, axis=1) >= 0)  # (B,) ids are 0 (padding) or more
  if not (opts.has_lengths or opts.has_segments):
    return out
  return jnp.where(in_range[:, None, None, None], out, jnp.full((), jnp.nan, out.dtype))
