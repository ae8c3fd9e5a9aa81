"""Per-row lengths and causal alignment in `attnlayers.attention` (issue 11, the core), on a CPU.

naive and xla against the float64 reference (tests/reference.py), outputs and q/k/v
gradients, for the calls decoding makes: a one-token step against a KV cache, a prefill chunk
at per-row offsets, and the corners (rows with no query or no key, a mask on top). Then the
errors for bad lengths and alignments, and the NaN rows that out-of-range lengths give under jit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlayers
from tests import cases, reference

BACKENDS = ["naive", "xla"]
H = 8  # head dim: small, the CI box has 2 cores


def _i32(x):
  return None if x is None else jnp.asarray(x, jnp.int32)


# name -> (B, T, S, is_causal, causal_alignment, query_seq_lengths, key_value_seq_lengths)
SCENARIOS = {
    # one new token per row against a cache of 16: row b is at position pos_b = (0, 7, 15), Sb = pos_b + 1
    "decode-step": (3, 1, 16, True, "bottom-right", [1, 1, 1], [1, 8, 16]),
    # 8 new tokens at positions (0, 5, 16), of which (8, 3, 8) are real: Sb = pos_b + len_b
    "prefill-chunk": (3, 8, 24, True, "bottom-right", [8, 3, 8], [8, 8, 24]),
    # bottom-right with T != S and no lengths: query t sees keys s <= t + S - T
    "bottom-right-no-lengths": (2, 4, 12, True, "bottom-right", None, None),
    "top-left-lengths": (3, 8, 16, True, "top-left", [8, 5, 2], [16, 3, 10]),
    "no-causal-lengths": (3, 8, 16, False, "top-left", [8, 5, 2], [16, 3, 10]),
    "kv-lengths-only": (3, 8, 16, False, "top-left", None, [16, 3, 1]),
    # row 0 no queries, row 1 no keys, row 2 more queries than keys: its first 4 see nothing bottom-right
    "empty-rows-bottom-right": (3, 8, 16, True, "bottom-right", [0, 4, 6], [5, 0, 2]),
    "empty-rows-top-left": (3, 8, 16, True, "top-left", [0, 4, 6], [5, 0, 2]),
    "empty-rows-no-causal": (3, 8, 16, False, "top-left", [0, 4, 6], [5, 0, 2]),
}


def check(backend, heads, scenario, *, masked=False, dtype=jnp.float32, head_dim=H, forward_only=False, **options):
  """Outputs and gradients against the reference; exact zeros (and zero dq) where a query has no key.

  scenario: a (B, T, S, is_causal, causal_alignment, query_seq_lengths, key_value_seq_lengths)
  tuple, as SCENARIOS holds; options: further keyword arguments of attention() (fp8_core).
  forward_only: the backend runs this call forward only; its gradient must raise NotImplementedError
  saying so (jax's cuDNN attention at T=1), and the outputs are checked.
  Returns the (B, T, N) bool of queries with no allowed key.
  """
  B, T, S, causal, alignment, q_len, kv_len = scenario
  case = dict(heads=heads, causal=causal, masked=masked, dtype=dtype)
  q, k, v, dout, mask = cases.inputs(case, B=B, T=T, S=S, H=head_dim)  # a mask keeps key 0 in every row

  def loss(q, k, v, q_len, kv_len):
    out = attnlayers.attention(q, k, v, backend=backend, is_causal=causal, mask=mask, causal_alignment=alignment,
                               query_seq_lengths=q_len, key_value_seq_lengths=kv_len, **options)
    return jnp.sum(out.astype(jnp.float32) * dout), out

  if forward_only:
    with pytest.raises(NotImplementedError, match="no backward pass for one query"):
      jax.jit(jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2)))(q, k, v, _i32(q_len), _i32(kv_len))
    out = jax.jit(lambda *a: loss(*a)[1])(q, k, v, _i32(q_len), _i32(kv_len))
    grads = None
  else:
    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = run(q, k, v, _i32(q_len), _i32(kv_len))
  assert out.dtype == q.dtype and out.shape == q.shape
  rule = dict(mask=None if mask is None else np.asarray(mask), is_causal=causal, causal_alignment=alignment,
              query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
  qkv = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v)]
  want, p = reference.forward(*qkv, **rule)
  what = f"{backend} {heads} B{B} T{T} S{S} causal={causal} {alignment}{' mask' if masked else ''}"
  reference.assert_close(out, want, dtype, "out", f"{what} output")
  for name, got, ref in zip("qkv", grads or (), reference.gradients(*qkv, np.asarray(dout), **rule) if grads else ()):
    assert got.dtype == q.dtype
    assert np.isfinite(np.asarray(got.astype(jnp.float32))).all(), f"{what} d{name} not finite"
    reference.assert_close(got, ref, dtype, "grad", f"{what} d{name}")
  empty = p.sum(-1).transpose(0, 2, 1) == 0  # (B, T, N): queries with no allowed key
  f32 = lambda x: np.asarray(x.astype(jnp.float32))
  np.testing.assert_array_equal(f32(out)[empty], 0.0, err_msg=f"{what}: output of a query with no key")
  if grads is not None:
    np.testing.assert_array_equal(f32(grads[0])[empty], 0.0, err_msg=f"{what}: dq of a query with no key")
  return empty


@pytest.mark.parametrize("heads", list(cases.HEADS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_and_alignment_match_reference(backend, scenario, heads):
  empty = check(backend, heads, SCENARIOS[scenario])
  if scenario.startswith("empty-rows"):
    assert empty[0].all() and empty[1].all(), "rows 0 (no queries) and 1 (no keys) are empty throughout"


@pytest.mark.parametrize("scenario", ["decode-step", "prefill-chunk", "top-left-lengths", "empty-rows-bottom-right"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_combine_with_a_mask(backend, scenario):
  check(backend, "GQA", SCENARIOS[scenario], masked=True)


def test_reference_decode_step_sees_exactly_the_cache_so_far():
  """The reference's own rule, by hand: a decode step at position p attends keys 0..p and nothing else."""
  keep = reference.allowed(1, 6, is_causal=True, causal_alignment="bottom-right", query_seq_lengths=[1, 1, 1],
                           key_value_seq_lengths=[1, 3, 6])
  np.testing.assert_array_equal(keep[:, 0, 0], [[1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
  keep = reference.allowed(3, 5, is_causal=True, causal_alignment="bottom-right", query_seq_lengths=[2],
                           key_value_seq_lengths=[4])  # 2 real queries at positions 2 and 3
  np.testing.assert_array_equal(keep[0, 0], [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]])


# --- bad input: one clear error naming the value, from attention() and explain() alike ---

q = jnp.zeros((3, 4, 4, H))
kv = jnp.zeros((3, 8, 2, H))
BAD = {
    # name -> (keyword arguments, error type, what the message must name)
    "q-lengths-wrong-shape": (dict(query_seq_lengths=jnp.array([1, 2], jnp.int32)), ValueError, r"\(2,\)"),
    "kv-lengths-2d": (dict(key_value_seq_lengths=jnp.ones((3, 1), jnp.int32)), ValueError, r"\(3, 1\)"),
    "kv-lengths-float": (dict(key_value_seq_lengths=jnp.array([1.0, 2.0, 3.0])), ValueError, "float32"),
    "q-lengths-list": (dict(query_seq_lengths=[1, 2, 3]), TypeError, "list"),
    "kv-lengths-above-S": (dict(key_value_seq_lengths=jnp.array([8, 9, 3], jnp.int32)), ValueError, r"\b9\b"),
    "kv-lengths-negative": (dict(key_value_seq_lengths=jnp.array([8, 2, -1], jnp.int32)), ValueError, "-1"),
    "q-lengths-above-T": (dict(query_seq_lengths=jnp.array([5, 0, 4], jnp.int32)), ValueError, r"\b5\b"),
    "alignment-typo": (dict(is_causal=True, causal_alignment="bottom_right"), ValueError, "'bottom_right'"),
    "bottom-right-without-causal": (dict(causal_alignment="bottom-right"), ValueError, r"'bottom-right'.*is_causal"),
}


@pytest.mark.parametrize("entry", ["attention", "explain"])
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_lengths_and_alignment_raise_naming_the_value(bad, entry):
  kwargs, error, names = BAD[bad]
  call = {"attention": lambda: attnlayers.attention(q, kv, kv, backend="xla", **kwargs),
          "explain": lambda: attnlayers.explain("auto", q, kv, kv, **kwargs)}[entry]
  with pytest.raises(error, match=names):
    call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_lengths_under_jit_make_their_rows_nan(backend):
  """Traced lengths cannot raise: a row whose length is out of range is NaN, the others are untouched."""
  qs, ks, vs, _, _ = cases.inputs(dict(heads="GQA", causal=True, masked=False, dtype=jnp.float32), B=3, T=4, S=8, H=H)
  attend = lambda q_len, kv_len: attnlayers.attention(qs, ks, vs, backend=backend, is_causal=True,
                                                      causal_alignment="bottom-right", query_seq_lengths=q_len,
                                                      key_value_seq_lengths=kv_len)
  run = jax.jit(attend)
  out = np.asarray(run(_i32([4, 5, 2]), _i32([8, 6, 9])))  # row 1: Tb > T; row 2: Sb > S
  assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
  np.testing.assert_array_equal(out[0], np.asarray(run(_i32([4, 4, 2]), _i32([8, 6, 8])))[0])
  out = np.asarray(run(_i32([4, 4, -1]), _i32([-1, 6, 8])))  # negative lengths
  assert np.isnan(out[0]).all() and np.isnan(out[2]).all() and np.isfinite(out[1]).all()


def test_explain_names_the_backend_auto_runs_for_a_decode_step():
  """A float32 decode step: auto picks xla (cudnn takes only fp16/bf16), says so, and lowers to xla's program."""
  qs, ks, vs, _, _ = cases.inputs(dict(heads="GQA", causal=True, masked=False, dtype=jnp.float32), B=2, T=1, S=16, H=H)
  options = dict(is_causal=True, causal_alignment="bottom-right", query_seq_lengths=_i32([1, 1]),
                 key_value_seq_lengths=_i32([4, 16]))
  plan = attnlayers.explain("auto", qs, ks, vs, **options)
  assert plan.chosen == "xla", str(plan)
  assert "auto chose 'xla'" in str(plan), str(plan)
  attend = lambda q, k, v, q_len, kv_len, backend: attnlayers.attention(
      q, k, v, backend=backend, is_causal=True, causal_alignment="bottom-right", query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len)
  run = jax.jit(attend, static_argnames="backend")
  args = (qs, ks, vs, options["query_seq_lengths"], options["key_value_seq_lengths"])
  program = {b: run.lower(*args, backend=b).as_text() for b in ("auto", "xla", "naive")}
  assert program["auto"] == program["xla"] != program["naive"]
