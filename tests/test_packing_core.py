"""Segment ids (packed documents) and sliding windows in `attnlayers.attention` (issue 12, the core), on a CPU.

Every CPU backend (naive, xla, and auto, which picks one of them here) against the float64
reference (tests/reference.py), outputs and q/k/v gradients, MHA/GQA/MQA: random segment layouts
with one-token documents and all-padding rows, windows (left-only, both sides, wider than T,
zero), alone and with causality, lengths and masks; queries with no key output exactly 0.
Then the regression test for attention across documents, and the errors for bad input.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlayers
from attnlayers import spec
from tests import cases, reference

BACKENDS = ["naive", "xla", "auto"]
H = 8


def packed(B: int, T: int, seed: int, *, padding_row: bool = True) -> np.ndarray:
  """(B, T) int32 ids: documents of random lengths (some one token long) end to end, padding (0) at the end;
  with padding_row, the last row is all padding."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((B, T), np.int32)
  for b in range(B - 1 if padding_row else B):
    t, doc = 0, int(rng.integers(1, 5))
    end = T - int(rng.integers(0, 4))  # some trailing padding
    while t < end:
      n = min(int(rng.choice([1, 1, 2, 3, 5, 8])), end - t)
      ids[b, t:t + n] = doc
      t, doc = t + n, doc + int(rng.integers(1, 3))  # ids increase, not always by one
  return ids


def check(backend, heads, *, T=12, S=None, B=3, masked=False, is_causal=False, window=None, segment_ids=None,
          q_len=None, kv_len=None, alignment="top-left", seed=0, dtype=jnp.float32, head_dim=H, max_segments=None,
          mask=None, bias=None):
  """Outputs and gradients against the reference; exact zeros for queries with no allowed key. Returns that
  (B, T, N) bool. mask: the caller's, bool broadcastable to (B, N, T, S) (masked: a random one instead); bias:
  an additive one, likewise."""
  S = T if S is None else S
  case = dict(heads=heads, causal=is_causal, masked=False, dtype=dtype)
  q, k, v, dout, _ = cases.inputs(case, B=B, T=T, S=S, H=head_dim, seed=seed)
  if masked:  # random, but each query keeps its own position (T == S): the mask alone empties no row
    mask = jax.random.bernoulli(jax.random.key(seed + 7), 0.6, (B, 1, T, S)) | jnp.eye(T, S, dtype=bool)
  seg = None if segment_ids is None else (jnp.asarray(segment_ids) if not isinstance(segment_ids, tuple)
                                          else tuple(jnp.asarray(x) for x in segment_ids))
  i32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)

  def loss(q, k, v):
    out = attnlayers.attention(q, k, v, backend=backend, is_causal=is_causal, mask=mask, window=window,
                               segment_ids=seg, query_seq_lengths=i32(q_len), key_value_seq_lengths=i32(kv_len),
                               causal_alignment=alignment, max_segments=max_segments, bias=bias)
    return jnp.sum(out.astype(jnp.float32) * dout), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  rule = dict(mask=None if mask is None else np.asarray(mask), is_causal=is_causal, window=window,
              segment_ids=segment_ids, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
              causal_alignment=alignment, bias=None if bias is None else np.asarray(bias, np.float64))
  qkv = [np.asarray(x, np.float64) for x in (q, k, v)]
  want, p = reference.forward(*qkv, **rule)
  what = f"{backend} {heads} T{T} S{S} causal={is_causal} window={window} segments={segment_ids is not None}"
  reference.assert_close(out, want, dtype, "out", f"{what} output")
  for name, got, ref in zip("qkv", grads, reference.gradients(*qkv, np.asarray(dout, np.float64), **rule)):
    assert np.isfinite(np.asarray(got, np.float32)).all(), f"{what} d{name} not finite"
    reference.assert_close(got, ref, dtype, "grad", f"{what} d{name}")
  empty = p.sum(-1).transpose(0, 2, 1) == 0  # (B, T, N)
  np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0, err_msg=f"{what}: output of a query with no key")
  np.testing.assert_array_equal(np.asarray(grads[0], np.float32)[empty], 0.0, err_msg=f"{what}: dq of a query with no key")
  return empty


WINDOWS = {"left-only": (3, 0), "both-sides": (2, 3), "wider-than-T": (50, 50), "zero": (0, 0), "right-only": (0, 2)}


@pytest.mark.parametrize("heads", list(cases.HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_segments_match_reference(backend, heads):
  empty = check(backend, heads, segment_ids=packed(3, 12, seed=1))
  assert empty[-1].all(), "the all-padding row attends nothing"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_windows_match_reference(backend, window, causal):
  check(backend, "GQA", window=WINDOWS[window], is_causal=causal)


@pytest.mark.parametrize("heads", list(cases.HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_segments_window_causal_mask_and_lengths_compose(backend, heads):
  check(backend, heads, segment_ids=packed(3, 12, seed=2), window=(2, 1), is_causal=True, masked=True,
        q_len=[12, 9, 4], kv_len=[12, 10, 12])


@pytest.mark.parametrize("backend", BACKENDS)
def test_separate_query_and_key_segments_with_bottom_right_window(backend):
  """A chunk of 4 queries at the end of 12 keys (a packed prefill): segment ids per side, window (3, 0)."""
  kv_ids = packed(2, 12, seed=3, padding_row=False)
  check(backend, "MQA", T=4, S=12, B=2, segment_ids=(kv_ids[:, -4:], kv_ids), window=(3, 0), is_causal=True,
        alignment="bottom-right")


def test_one_array_of_ids_needs_T_equal_S():
  q, kv = jnp.zeros((1, 4, 2, H)), jnp.zeros((1, 6, 2, H))
  with pytest.raises(ValueError, match=r"T == S.*pair"):
    attnlayers.attention(q, kv, kv, backend="xla", segment_ids=jnp.ones((1, 4), jnp.int32))


BAD = {
    "window-negative": (dict(window=(-1, 0)), "two ints >= 0"),
    "window-one-int": (dict(window=4), "two ints >= 0"),
    "window-float": (dict(window=(2.0, 0)), "two ints >= 0"),
    "segments-wrong-shape": (dict(segment_ids=jnp.ones((2, 5), jnp.int32)), r"\(B, T\) = \(2, 6\)"),
    "segments-float": (dict(segment_ids=jnp.ones((2, 6))), "float32"),
    "segments-negative": (dict(segment_ids=jnp.full((2, 6), -1, jnp.int32)), ">= 0"),
    "segments-triple": (dict(segment_ids=(jnp.ones((2, 6), jnp.int32),) * 3), "pair"),
    # int32 wraps these: 2**32 + 1 would read as 1, 2**31 + 1 as a negative id
    "segments-past-int32": (dict(segment_ids=np.full((2, 6), 2**32 + 1, np.int64)), r"must fit int32 .*4294967297"),
    "segments-uint32-past-int32": (dict(segment_ids=np.full((2, 6), 2**31 + 1, np.uint32)), "must fit int32"),
    "window-past-2**30": (dict(window=(0, 2**31 - 1)), r"at most 2\*\*30"),  # p + right wrapped: rows emptied
}


@pytest.mark.parametrize("entry", ["attention", "explain"])
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_segments_and_windows_raise(bad, entry):
  kwargs, message = BAD[bad]
  q = jnp.zeros((2, 6, 2, H))
  call = {"attention": lambda: attnlayers.attention(q, q, q, backend="xla", **kwargs),
          "explain": lambda: attnlayers.explain("auto", q, q, q, **kwargs)}[entry]
  with pytest.raises(ValueError, match=message):
    call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_segment_ids_under_jit_make_their_rows_nan(backend):
  """Traced ids cannot raise (eagerly a negative id is refused): a row holding one, in the queries' or the keys'
  ids, is NaN rather than a document of its own; the other rows are untouched."""
  q, k, v, _, _ = cases.inputs(dict(heads="GQA", causal=True, masked=False, dtype=jnp.float32), B=3, T=8, S=8, H=H)
  run = jax.jit(lambda ids, kv_ids: attnlayers.attention(q, k, v, backend=backend, is_causal=True,
                                                         segment_ids=(ids, kv_ids)))
  good = jnp.asarray(np.repeat([[1, 1, 1, 2, 2, 2, 0, 0]], 3, axis=0), jnp.int32)  # (B, T)
  out = np.asarray(run(good.at[1, 5].set(-1), good.at[2, 0].set(-3)))  # row 1: a query's id; row 2: a key's
  assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
  np.testing.assert_array_equal(out[0], np.asarray(run(good, good))[0])


def test_reference_rule_by_hand():
  """The reference's own rule on a small case, written out: two documents, a padding tail, window (1, 0)."""
  keep = reference.allowed(5, 5, is_causal=True, segment_ids=np.array([[1, 1, 2, 2, 0]]), window=(1, 0))
  np.testing.assert_array_equal(keep[0, 0].astype(int), [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                                                         [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])


@pytest.mark.parametrize("backend", attnlayers.BACKENDS)
def test_no_backend_lets_a_query_see_another_document(backend):
  """MaxText's cuDNN path dropped segment ids, so packed training attended across documents. Here every
  backend either keeps document 1's outputs the same whatever document 2 holds, or refuses the call
  saying it does not take segment ids; none runs it while ignoring them."""
  B, T, N, K = 2, 16, 4, 2
  dtype = jnp.bfloat16 if backend in ("cudnn", "te", "te-fp8") else jnp.float32
  ids = jnp.asarray(np.repeat([[1] * 7 + [2] * 9], B, axis=0), jnp.int32)
  q, k, v = (jax.random.normal(jax.random.key(i), (B, T, n, 64)).astype(dtype) for i, n in enumerate((N, K, K)))
  plan = attnlayers.explain(backend, q, k, v, is_causal=True, segment_ids=ids)
  if not plan.ok:
    reasons = [r for rs in plan.unmet.values() for r in rs]
    if any("segment ids" in r for r in reasons):
      return  # refused, saying it takes no segment ids: a rule of the call, the same on every machine
    assert backend == "auto" or any("GPU" in r or "TPU" in r for r in reasons), reasons  # only the machine may stop it
    pytest.skip(f"{backend} cannot run here, so it cannot be checked: " + "; ".join(reasons))
  run = jax.jit(lambda k, v: attnlayers.attention(q, k, v, backend=backend, is_causal=True, segment_ids=ids))
  other = jnp.arange(T)[None, :, None, None] >= 7  # document 2's positions
  k2, v2 = jnp.where(other, 10 * k + 3, k), jnp.where(other, -5 * v, v)
  a, b = np.asarray(run(k, v), np.float32), np.asarray(run(k2, v2), np.float32)
  np.testing.assert_array_equal(a[:, :7], b[:, :7], err_msg=f"{backend}: document 1 saw document 2")
  assert not np.allclose(a[:, 7:], b[:, 7:]), "document 2's own outputs must change (the test can fail)"


hypothesis = pytest.importorskip("hypothesis", reason="hypothesis (a dev dependency: pip install -e '.[dev]')")
st = hypothesis.strategies


@st.composite
def layouts(draw):
  """A random call: shapes, heads, causality and alignment, a window or none, segment ids or none, lengths or none."""
  B, T = draw(st.integers(1, 3)), draw(st.integers(1, 10))
  S = T if draw(st.booleans()) else draw(st.integers(1, 12))
  causal = draw(st.booleans())
  alignment = draw(st.sampled_from(["top-left", "bottom-right"])) if causal else "top-left"
  window = draw(st.none() | st.tuples(st.integers(0, 12), st.integers(0, 12)))
  ids = lambda n: np.asarray(draw(st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=B,
                                           max_size=B)), np.int32).reshape(B, n)
  segments = None
  if draw(st.booleans()):
    segments = ids(T) if S == T and draw(st.booleans()) else (ids(T), ids(S))
  lens = lambda n: draw(st.none() | st.lists(st.integers(0, n), min_size=B, max_size=B))
  return dict(B=B, T=T, S=S, heads=draw(st.sampled_from(list(cases.HEADS))), is_causal=causal, alignment=alignment,
              window=window, segment_ids=segments, q_len=lens(T), kv_len=lens(S), seed=draw(st.integers(0, 99)))


@pytest.mark.parametrize("backend", ["naive", "xla"])
@hypothesis.settings(max_examples=15, deadline=None, derandomize=True)
@hypothesis.given(layout=layouts())
def test_random_layouts_match_reference(backend, layout):
  layout = dict(layout)
  check(backend, layout.pop("heads"), **layout)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_the_mask_empties_outputs_zero(backend):
  """Query 3 of row 0 has an all-False mask row (head 1 only): zeros there, finite zero gradients, as the
  reference; not the average over every key that a softmax of equal scores gives."""
  B, T, N = 2, 8, 4
  q, k, v, dout, _ = cases.inputs(dict(heads="GQA", causal=False, masked=False, dtype=jnp.float32), B=B, T=T, S=T, H=H)
  mask = jnp.ones((B, N, T, T), bool).at[0, 1, 3].set(False)

  def loss(q, k, v):
    out = attnlayers.attention(q, k, v, backend=backend, mask=mask)
    return jnp.sum(out * dout), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  qkv = [np.asarray(x, np.float64) for x in (q, k, v)]
  reference.assert_close(out, reference.forward(*qkv, mask=np.asarray(mask))[0], jnp.float32)
  assert np.asarray(out)[0, 3, 1].tolist() == [0.0] * H and np.abs(np.asarray(out)[0, 3, 0]).max() > 0
  for got, ref in zip(grads, reference.gradients(*qkv, np.asarray(dout), mask=np.asarray(mask))):
    assert np.isfinite(np.asarray(got)).all()
    reference.assert_close(got, ref, jnp.float32, "grad")


EMPTIED_TOGETHER = {  # (the rule, a mask that leaves some query no key the rule allows, though its mask row is not
    # all False): row 0, query 0 or 5 (B=2, T=S=8)
    "causal": dict(is_causal=True),  # query 0 may see key 0 only; the mask drops key 0
    "window": dict(window=(0, 0)),  # each query sees itself only; the mask drops key 5 for query 5
    "lengths": dict(kv_len=[3, 8]),  # row 0 has 3 keys; the mask gives query 5 only keys 3 and up
    "segments": dict(segment_ids=np.array([[1, 1, 1, 1, 1, 2, 2, 2], [1] * 8], np.int32)),  # query 5: keys 5-7
}


@pytest.mark.parametrize("rule", EMPTIED_TOGETHER)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_the_mask_and_the_rule_empty_together_outputs_zero(backend, rule):
  """A mask row with keys left, none of them one the rule allows the query: zeros and zero gradients, as the
  reference; not the average over every key, future ones included, that a softmax over no allowed key gives."""
  mask = np.ones((2, 1, 8, 8), bool)
  mask[0, 0, 0, 0] = False  # query 0: every key but 0
  mask[0, 0, 5, 5:] = False  # query 5: keys 0-4
  mask[0, 0, 5, :3] = rule != "lengths"  # lengths: keys 3-4 only, past row 0's 3
  empty = check(backend, "GQA", T=8, B=2, mask=jnp.asarray(mask), **EMPTIED_TOGETHER[rule])
  assert empty[0, 0].all() or empty[0, 5].all(), f"{rule}: the case empties no row"
  assert mask[0, 0, 0].any() and mask[0, 0, 5].any()  # the mask alone empties none


def minus_inf_bias(B: int, T: int, dtype=jnp.float32):
  """(B, 1, T, T) bias=jnp.where(mask, 0, -inf): every key of row 1's query 2 at -inf, row 0's query 0 without
  key 0 and query 5 without keys 5 and up, the rest 0 (rows EMPTIED_TOGETHER's rules empty with it)."""
  mask = np.ones((B, 1, T, T), bool)
  mask[0, 0, 0, 0] = False
  mask[0, 0, 5, 5:] = False
  mask[1, 0, 2] = False
  return jnp.where(jnp.asarray(mask), 0.0, -jnp.inf).astype(dtype)


@pytest.mark.parametrize("rule", ["alone"] + list(EMPTIED_TOGETHER))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_a_minus_inf_bias_empties_outputs_zero(backend, rule):
  """An additive mask (bias=jnp.where(mask, 0, -inf), PyTorch's form) means what mask= means: a query it leaves
  no key, alone or with the rule, outputs 0 with zero gradients, not the NaN of a softmax over -inf scores."""
  empty = check(backend, "GQA", T=8, B=2, bias=minus_inf_bias(2, 8), **EMPTIED_TOGETHER.get(rule, {}))
  assert empty[1, 2].all(), "the bias empties row 1's query 2 whatever the rule"


def test_packed_layout_relabels_runs_and_flags_ids_it_cannot_hold():
  """backends/_packing.runs: what te's THD layout receives (run ids 1, 2, ..., positions in the run) and which
  rows it can hold (each document one run, at most max_segments runs)."""
  from attnlayers.backends import _packing
  ids = np.array([[7, 7, 0, 9, 9, 9, 0, 0],   # gaps in ids, padding between and after: fine
                  [1, 1, 2, 2, 1, 1, 0, 0],   # document 1 split in two runs: not holdable
                  [3, 3, 3, 2, 2, 0, 0, 0],   # ids fall: holdable (the runs are relabelled 1, 2)
                  [1, 2, 3, 4, 5, 6, 7, 8]])  # eight one-token documents: more than max_segments=4
  rid, pos, ok = (np.asarray(x) for x in _packing.runs(jnp.asarray(ids), max_segments=4))
  np.testing.assert_array_equal(rid[0], [1, 1, 0, 2, 2, 2, 0, 0])
  np.testing.assert_array_equal(pos[0], [0, 1, 0, 0, 1, 2, 0, 0])
  np.testing.assert_array_equal(ok, [True, False, True, False])
  np.testing.assert_array_equal(rid[2], [1, 1, 1, 2, 2, 0, 0, 0])
  np.testing.assert_array_equal(attnlayers.spec.count_runs(ids), [2, 3, 2, 8])


@pytest.mark.parametrize("bad, message", [(0, "int >= 1"), (2.5, "int >= 1"), (True, "int >= 1")])
def test_bad_max_segments_raise(bad, message):
  q = jnp.zeros((2, 6, 2, H))
  with pytest.raises(ValueError, match=message):
    attnlayers.attention(q, q, q, backend="xla", segment_ids=jnp.ones((2, 6), jnp.int32), max_segments=bad)


def test_max_segments_needs_segment_ids_and_bounds_concrete_ids():
  q = jnp.zeros((1, 6, 2, H))
  with pytest.raises(ValueError, match="pass segment_ids"):
    attnlayers.attention(q, q, q, backend="xla", max_segments=2)
  with pytest.raises(ValueError, match="^segment_ids: row 0 holds 3 documents"):  # one array: named as given
    attnlayers.attention(q, q, q, backend="xla", segment_ids=jnp.array([[1, 1, 2, 2, 3, 3]]), max_segments=2)
  ids = jnp.array([[1, 1, 2, 2, 3, 3]])
  with pytest.raises(ValueError, match="^kv_segment_ids: row 0 holds 3 documents"):
    attnlayers.attention(q, q, q, backend="xla", segment_ids=(jnp.ones((1, 6), jnp.int32), ids), max_segments=2)
  ids = jnp.array([[1, 1, 2, 2, 3, 3]])
  with pytest.raises(ValueError, match="row 0 holds 3 documents"):  # concrete ids closed over while a jit traces
    jax.jit(lambda q: attnlayers.attention(q, q, q, backend="xla", segment_ids=ids, max_segments=2))(q)


def test_a_tight_max_segments_on_concrete_ids_inside_jit_matches_reference():
  ids = jnp.asarray(packed(3, 12, seed=4))  # a jax array closed over by the jitted loss: concrete while it traces
  check("xla", "GQA", T=12, is_causal=True, segment_ids=ids, max_segments=int(spec.count_runs(ids).max()))
