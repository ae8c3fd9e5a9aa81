"""The float64 numpy reference for attention, its gradients, and the per-dtype tolerances.

Every backend's outputs and gradients are compared with these in float64, with tolerances
chosen here and nowhere else.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# (atol, rtol) per dtype and quantity, against the float64 reference. bfloat16 keeps 8
# mantissa bits (relative step 2^-8 = 0.0039): q/k/v rounding plus a bf16 output and bf16
# weights in the values matmul give errors of a few steps on O(1) values.
TOLERANCES = {
    ("float32", "out"): (5e-6, 5e-6),
    ("float32", "grad"): (1e-5, 1e-5),
    ("bfloat16", "out"): (2e-2, 2e-2),
    ("bfloat16", "grad"): (4e-2, 4e-2),
    ("float16", "out"): (3e-3, 3e-3),
    ("float16", "grad"): (6e-3, 6e-3),
    # float64 inputs (with jax_enable_x64) run in float64 throughout: the same sums in another order, 2^-52
    # relative apart each; a float32 step anywhere (a softmax in float32) is off by 1e-7 and fails.
    ("float64", "out"): (1e-12, 1e-12),
    ("float64", "grad"): (1e-12, 1e-12),
    # A training run's losses over 20 steps on several devices against one device (tests/test_mesh.py): the same
    # sums in another order, a few float32 steps apart (2^-23 relative each); a wrong shard or a missing
    # reduction moves the second step's loss by orders of magnitude more.
    ("float32", "loss across meshes"): (0.0, 1e-5),
}


# FP8 (te-fp8: E4M3 q, k, v, probabilities P and output O; 3 mantissa bits, so each rounding
# is off by up to 2^-4 relative): every element within 2^-3 of the tensor's largest reference
# value, i.e. two E4M3 steps at the top of the range. The error measured is printed. This
# rule alone passes an output 1.1x too large; FP8_QUANTISED is the one that does not.
FP8_FRACTION_OF_MAX = {"out": 2.0**-3, "grad": 2.0**-3}

# te-fp8's FP8 core against the float64 attention of q, k, v as the core quantises them
# (fp8_quantised): what remains is the kernel's rounding of P (E4M3, scale 448) and of O (E4M3,
# then bf16/fp16), each at most 2^-4 relative per element, round to nearest: noise that is
# unbiased and independent of the values. One rounding's error has an RMS of at most
# 2^-4 / sqrt(3) of the values rounded (uniform within half a step); P's, summed over the keys
# with weights v, adds about as much to O again, so together about sqrt(2 / 3) * 2^-4 = 0.051.
# The gradients (a bf16 backward on the dequantised q, k, v) see O's error only through
# rowsum(dout * O). Hence, per tensor:
#   "rms":   rms(actual - reference) <= 2^-4 * rms(reference);
#   "scale": the least-squares factor <actual, reference> / <reference, reference> is within
#            2^-5 of 1: noise independent of the reference moves it by about rms / sqrt(size).
# A tensor 1.1x its reference fails both (rms error 0.1, factor 1.1).
FP8_QUANTISED = {"out": dict(rms=2.0**-4, scale=2.0**-5), "grad": dict(rms=2.0**-4, scale=2.0**-5)}
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


def tolerance(dtype, kind: str = "out") -> dict:
  atol, rtol = TOLERANCES[(np.dtype(dtype).name, kind)]
  return dict(atol=atol, rtol=rtol)


def assert_close(actual, expected, dtype, kind: str = "out", what: str = ""):
  """dtype: the inputs' dtype, or "fp8" for the FP8 rule above."""
  actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
  if isinstance(dtype, str) and dtype == "fp8":
    atol = FP8_FRACTION_OF_MAX[kind] * float(np.abs(expected).max())
    err = float(np.abs(actual - expected).max())
    print(f"{what}: max |error| / max |reference| = {err / float(np.abs(expected).max()):.4f}")
    assert err <= atol, f"{what}: max |error| {err:.4g} > {atol:.4g} = {FP8_FRACTION_OF_MAX[kind]} * max |reference|"
    return
  np.testing.assert_allclose(actual, expected, err_msg=what, **tolerance(dtype, kind))


def fp8_scale(amax) -> float:
  """te-fp8's per-tensor scale for a tensor whose largest |value| is amax: the largest power of two s with
  amax * s <= 448, so that dequantising is exact (1 for amax 0, as delayed scaling starts)."""
  amax = float(amax)
  return 1.0 if amax == 0 else float(2.0 ** np.floor(np.log2(E4M3_MAX / amax)))


def fp8_quantised(x, scale=None):
  """x as te-fp8's FP8 core holds it, in float64: x * scale rounded to E4M3 (saturating at +-448), / scale.

  scale: a power of two; default fp8_scale(max|x|), current scaling's (delayed scaling passes its history's).
  """
  x = np.asarray(x, np.float32)  # bf16/fp16 -> float32 and * 2^n are exact, as in the core
  scale = fp8_scale(np.abs(x).max()) if scale is None else float(scale)
  y = np.clip(x * np.float32(scale), -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
  return y.astype(np.float64) / scale


def assert_fp8_matches_quantised(actual, expected, kind: str = "out", what: str = ""):
  """actual: te-fp8's FP8-core output or gradient; expected: the float64 reference on fp8_quantised inputs.
  The FP8_QUANTISED rules (its comment says why); the measured values are printed."""
  a, e = np.asarray(actual, np.float32).astype(np.float64), np.asarray(expected, np.float64)
  rms = np.sqrt(np.mean((a - e) ** 2) / np.mean(e**2))
  factor = float(np.sum(a * e) / np.sum(e * e))
  limits = FP8_QUANTISED[kind]
  print(f"{what}: vs quantised inputs: rms error / rms = {rms:.4f}, least-squares factor = {factor:.5f}")
  assert rms <= limits["rms"], f"{what}: rms error {rms:.4g} of the reference's rms > {limits['rms']} (FP8_QUANTISED)"
  assert abs(factor - 1) <= limits["scale"], \
      f"{what}: {factor:.5g} times the reference (least squares), beyond 1 +- {limits['scale']} (FP8_QUANTISED)"


def check_fp8_core(out, grads, q, k, v, dout=None, *, is_causal: bool, scales=None, what: str = ""):
  """te-fp8's FP8 core against the float64 attention of its quantised inputs (assert_fp8_matches_quantised).

  out (B, T, N, H) and grads (dq, dk, dv) or None: what the core returned for q (B, T, N, H), k, v (B, S, K, H)
  and the cotangent dout (B, T, N, H) (needed with grads); scales (sq, sk, sv): the core's, default
  current scaling's (fp8_scale of each tensor's max|x|). The default softmax scale 1/sqrt(H).
  """
  scales = (None,) * 3 if scales is None else [float(s) for s in np.asarray(scales)]
  x64 = [fp8_quantised(x, s) for x, s in zip((q, k, v), scales)]  # (B, T|S, N|K, H) float64
  want, _ = forward(*x64, is_causal=is_causal)
  assert_fp8_matches_quantised(out, want, "out", f"{what} output")
  if grads is not None:
    want_grads = gradients(*x64, np.asarray(dout, np.float64), is_causal=is_causal)
    for name, got, ref in zip("qkv", grads, want_grads):
      assert_fp8_matches_quantised(got, ref, "grad", f"{what} d{name}")


def assert_close_sum(actual, expected, dtype, n: int, what: str = ""):
  """A gradient that sums n rows (a bias's, a LayerNorm scale's): the "grad" tolerance of one value, its atol
  grown by sqrt(n), as independent roundings of n terms add up. (Dividing both sides by n, as these checks did,
  grows atol by n: at bfloat16 and n = 4092 it passed a gradient half its true size.)"""
  atol, rtol = TOLERANCES[(np.dtype(dtype).name, "grad")]
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), err_msg=what,
                             atol=atol * float(np.sqrt(n)), rtol=rtol)


def allowed(T, S, mask=None, is_causal=False, *, query_seq_lengths=None, key_value_seq_lengths=None,
            causal_alignment="top-left", segment_ids=None, window=None):
  """Boolean keep[.., t, s]: query t may attend key s (attnlayers.spec's rule, written out again).

  query_seq_lengths Tb, key_value_seq_lengths Sb: int (B,), default T and S (right padding).
  Query (b, t) may attend key s iff t < Tb, s < Sb, the causal rule (if is_causal: s <= t
  top-left, s <= t + Sb - Tb bottom-right) and the mask. (T, S) without lengths, else (B, 1, T, S);
  either broadcasts to (B, N, T, S).
  segment_ids: (q (B, T), kv (B, S)) or one (B, T) array: equal non-zero ids only. window (left,
  right): the key's offset from the query's position (t, or t + Sb - Tb bottom-right) lies in
  [-left, right]. Either makes the result (B, 1, T, S).
  """
  if causal_alignment not in ("top-left", "bottom-right"):
    raise ValueError(f"causal_alignment: {causal_alignment!r}")
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]  # (T, 1), (1, S)
  if query_seq_lengths is None and key_value_seq_lengths is None:
    q_len, kv_len = np.array(T), np.array(S)  # () : the same for every row
  else:
    B = len(query_seq_lengths if query_seq_lengths is not None else key_value_seq_lengths)
    q_len = np.full(B, T) if query_seq_lengths is None else np.asarray(query_seq_lengths)
    kv_len = np.full(B, S) if key_value_seq_lengths is None else np.asarray(key_value_seq_lengths)
    q_len, kv_len = q_len[:, None, None, None], kv_len[:, None, None, None]  # (B, 1, 1, 1)
  keep = (t < q_len) & (s < kv_len)
  position = t + kv_len - q_len if is_causal and causal_alignment == "bottom-right" else t + 0 * kv_len
  if is_causal:
    keep = keep & (s <= position)
  if window is not None:
    offset = s - position  # how far right of the query's position the key is
    keep = keep & (offset >= -window[0]) & (offset <= window[1])
  if segment_ids is not None:
    q_ids, kv_ids = (segment_ids, segment_ids) if not isinstance(segment_ids, tuple) else segment_ids
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    same = np.stack([np.equal.outer(q_ids[b], kv_ids[b]) & (q_ids[b] != 0)[:, None] for b in range(len(q_ids))])
    keep = keep & same[:, None]  # (B, 1, T, S)
  if mask is not None:
    keep = np.logical_and(keep, np.asarray(mask, dtype=bool))
  return keep


def _expand_kv(x, N):
  """(B, S, K, H) -> (B, N, S, H) with query head n reading kv head n // (N // K)."""
  x = np.asarray(x, np.float64)
  return np.repeat(x, N // x.shape[2], axis=2).transpose(0, 2, 1, 3)


def forward(q, k, v, *, mask=None, is_causal=False, scale=None, bias=None, query_seq_lengths=None,
            key_value_seq_lengths=None, causal_alignment="top-left", segment_ids=None, window=None):
  """Returns (out (B, T, N, H), probabilities (B, N, T, S)) in float64.

  scores = q k^T * scale (default 1/sqrt(H)) + bias (broadcastable to (B, N, T, S)), then
  `allowed` (mask, causal limit, per-row lengths and alignment), then softmax over S. A
  query with no allowed key (padding, or left without a key by lengths/causality) has
  probabilities 0 and outputs exactly 0, as attnlayers.attention promises, whatever empties
  the row: lengths, causality, segments, the window, the mask, or the mask and one of the
  others together.
  """
  q = np.asarray(q, np.float64)
  B, T, N, H = q.shape
  S = k.shape[1]
  scale = 1.0 / np.sqrt(H) if scale is None else scale
  kx, vx = _expand_kv(k, N), _expand_kv(v, N)  # (B, N, S, H)
  scores = np.einsum("btnh,bnsh->bnts", q, kx) * scale  # (B, N, T, S)
  if bias is not None:
    scores = scores + np.asarray(bias, np.float64)
  keep = allowed(T, S, mask, is_causal, query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths, causal_alignment=causal_alignment,
                 segment_ids=segment_ids, window=window)
  scores = np.where(np.broadcast_to(keep, scores.shape), scores, -np.inf)
  top = scores.max(-1, keepdims=True)  # -inf on a row with no allowed key
  p = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
  total = p.sum(-1, keepdims=True)
  p = p / np.where(total > 0, total, 1.0)  # an empty row stays all 0
  return np.einsum("bnts,bnsh->btnh", p, vx), p


def gradients(q, k, v, dout, *, mask=None, is_causal=False, scale=None, bias=None, query_seq_lengths=None,
              key_value_seq_lengths=None, causal_alignment="top-left", segment_ids=None, window=None):
  """d(sum(out * dout)) / d(q, k, v) in float64, by the textbook softmax backward (bias held fixed).

  The lengths and alignment as in `forward`: a query with no allowed key has p = 0, so it gets a
  zero gradient and passes none to the keys.
  """
  q64 = np.asarray(q, np.float64)
  B, T, N, H = q64.shape
  K = k.shape[2]
  scale = 1.0 / np.sqrt(H) if scale is None else scale
  _, p = forward(q, k, v, mask=mask, is_causal=is_causal, scale=scale, bias=bias, query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths, causal_alignment=causal_alignment,
                 segment_ids=segment_ids, window=window)
  kx, vx = _expand_kv(k, N), _expand_kv(v, N)  # (B, N, S, H)
  g = np.asarray(dout, np.float64).transpose(0, 2, 1, 3)  # (B, N, T, H)
  dp = g @ vx.transpose(0, 1, 3, 2)  # (B, N, T, S)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  dq = (ds @ kx) * scale  # (B, N, T, H)
  dk = (ds.transpose(0, 1, 3, 2) @ q64.transpose(0, 2, 1, 3)) * scale  # (B, N, S, H)
  dv = p.transpose(0, 1, 3, 2) @ g  # (B, N, S, H)
  fold = lambda x: x.reshape(B, K, N // K, *x.shape[2:]).sum(2).transpose(0, 2, 1, 3)  # (B, S, K, H)
  return dq.transpose(0, 2, 1, 3), fold(dk), fold(dv)
