"""Lengths, causal alignment, segments and windows as the keys each query may attend, for every backend.

The rule (attnlayers.spec): query (b, t), at position p = t (or t + Sb - Tb bottom-right), may
attend key s iff t < Tb, s < Sb, s <= p if causal, its segment id equals the key's and is not 0,
p - left <= s <= p + right for a window, the caller's mask, and a bias that is not -inf there (an additive
mask, bias=jnp.where(mask, 0, -inf), means what mask= means). A query that is padding or that this rule leaves
without a key outputs exactly 0, on every backend (`finish`), with zero gradients. Lengths outside
[0, T] / [0, S] and negative segment ids that were traced (so spec.describe could not reject them) make their row
NaN rather than silently wrong.
"""

from __future__ import annotations

import jax.numpy as jnp

from attnlayers.spec import Call


def lengths(call: Call):
  """(Tb (B,), Sb (B,)) int32, defaulting to T and S."""
  B, T, S = call.B, call.T, call.S
  q = jnp.full((B,), T, jnp.int32) if call.query_seq_lengths is None else jnp.asarray(call.query_seq_lengths, jnp.int32)
  kv = jnp.full((B,), S, jnp.int32) if call.key_value_seq_lengths is None else jnp.asarray(call.key_value_seq_lengths,
                                                                                            jnp.int32)
  return q, kv


def plain(call: Call) -> bool:
  """No lengths, bottom-right causality, segments or window: the rule is at most top-left causality and the mask,
  which jax.nn.dot_product_attention takes as they are."""
  return not call.has_lengths and not call.bottom_right and not call.segments and call.window is None


def _positions(call: Call):
  """(t (1, T), p (B, T): each query's position against the keys, q_len (B, 1), kv_len (B, 1))."""
  q_len, kv_len = (x[:, None] for x in lengths(call))  # (B, 1)
  t = jnp.arange(call.T, dtype=jnp.int32)[None, :]  # (1, T)
  p = t + (kv_len - q_len) if call.bottom_right else jnp.broadcast_to(t, (call.B, call.T))
  return t, p, q_len, kv_len


def _key_range(call: Call, p, kv_len):
  """(lo, hi) (B, T): the keys s with lo <= s <= hi that lengths, causality and the window allow a query at p."""
  lo = jnp.zeros_like(p) if call.window is None else jnp.maximum(p - call.window[0], 0)
  hi = jnp.broadcast_to(kv_len - 1, p.shape)
  if call.is_causal:
    hi = jnp.minimum(hi, p)
  if call.window is not None:
    hi = jnp.minimum(hi, p + call.window[1])
  return lo, hi


def structural(call: Call):
  """Bool (B|1, 1, T, S): what lengths, causality, segments and the window allow (not the caller's mask);
  None if everything."""
  if plain(call):
    return jnp.tril(jnp.ones((call.T, call.S), jnp.bool_))[None, None] if call.is_causal else None
  t, p, q_len, kv_len = _positions(call)
  lo, hi = _key_range(call, p, kv_len)  # (B, T)
  s = jnp.arange(call.S, dtype=jnp.int32)[None, None, :]  # (1, 1, S)
  keep = (t < q_len)[:, :, None] & (s >= lo[:, :, None]) & (s <= hi[:, :, None])  # (B, T, S)
  if call.segments:
    q_ids, kv_ids = segment_ids(call)
    keep &= (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids != 0)[:, :, None]
  return keep[:, None]  # (B, 1, T, S)


def segment_ids(call: Call):
  """(q (B, T), kv (B, S)) int32 segment ids."""
  return jnp.asarray(call.q_segment_ids, jnp.int32), jnp.asarray(call.kv_segment_ids, jnp.int32)


def _four_dims(x):
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def caller_mask(call: Call):
  """Bool broadcastable to (B, N, T, S): the caller's mask and the keys the bias sets to -inf; None if the call
  has neither mask nor bias. (A NaN in the bias is not -inf: it stays in the scores.)"""
  mask = None if call.mask is None else _four_dims(call.mask)
  if call.bias is None:
    return mask
  finite = ~jnp.isneginf(_four_dims(call.bias))
  return finite if mask is None else mask & finite


def finite_bias(call: Call):
  """The bias with 0 where it is -inf (caller_mask removes those keys), for kernels that add a mask to it as a
  large negative number: -inf plus that stays -inf, and a row of -inf is NaN in their softmax. None: no bias."""
  if call.bias is None:
    return None
  return jnp.where(jnp.isneginf(call.bias), jnp.zeros((), call.bias.dtype), call.bias)


def allowed(call: Call):
  """Bool broadcastable to (B, N, T, S): structural() and caller_mask(); None if everything."""
  keep, mask = structural(call), caller_mask(call)
  if mask is None:
    return keep
  return mask if keep is None else keep & mask


def rows(call: Call):
  """Bool (B, T): queries that are real and have a key by lengths, causality, segments and the window;
  None if all do."""
  if plain(call):
    return None  # top-left causal leaves every query key 0
  t, p, q_len, kv_len = _positions(call)
  lo, hi = _key_range(call, p, kv_len)  # (B, T)
  valid = (t < q_len) & (lo <= hi)
  if call.shared_segments and not call.has_lengths:  # T == S, p = t: the query's own key is in [lo, hi]
    valid &= segment_ids(call)[0] != 0
  elif call.segments:  # some key of the query's own document in [lo, hi] (a reduction XLA fuses)
    q_ids, kv_ids = segment_ids(call)
    s = jnp.arange(call.S, dtype=jnp.int32)[None, None, :]  # (1, 1, S)
    same = (q_ids[:, :, None] == kv_ids[:, None, :]) & (s >= lo[:, :, None]) & (s <= hi[:, :, None])
    valid &= (q_ids != 0) & jnp.any(same, axis=-1)
  return valid  # (B, T)


def finish(out, call: Call):
  """out (B, T, N, H) with the rule's zero rows (also rows the caller's mask empties), and NaN rows for
  traced lengths out of range."""
  B, T, S = call.B, call.T, call.S
  valid = rows(call)
  if valid is not None:
    valid = valid[:, :, None, None]  # (B, T, 1, 1)
  if call.mask is not None or call.bias is not None:  # a query the mask (or a -inf bias) leaves no key the rule
    # allows: zeros too, not the uniform average over every key, future ones included, that the kernels' softmax
    # of equal scores gives
    keep = allowed(call)  # (B|1, N|1, T|1, S|1): the rule, the mask and the bias's -inf together
    some = jnp.any(keep, axis=-1).transpose(0, 2, 1)[..., None]  # (B|1, T|1, N|1, 1)
    valid = some if valid is None else valid & some
  if valid is not None:
    out = jnp.where(valid, out, jnp.zeros((), out.dtype))
  in_range = jnp.ones((B,), jnp.bool_)  # rows whose traced lengths and ids spec.describe could not check
  if call.has_lengths:
    q_len, kv_len = lengths(call)
    in_range &= (q_len >= 0) & (q_len <= T) & (kv_len >= 0) & (kv_len <= S)  # (B,)
  if call.segments:
    q_ids, kv_ids = segment_ids(call)
    in_range &= (jnp.min(q_ids, axis=1) >= 0) & (jnp.min(kv_ids, axis=1) >= 0)  # (B,) ids are 0 (padding) or more
  if not (call.has_lengths or call.segments):
    return out
  return jnp.where(in_range[:, None, None, None], out, jnp.full((), jnp.nan, out.dtype))
