"""On an NVIDIA GPU: segment ids (packed documents) and sliding windows on cudnn, te and te-fp8,
bfloat16, outputs and q/k/v gradients against the float64 reference (tests/test_packing_core.check),
each refusal with its reason, and proof in the compiled HLO that the fused kernel ran with the
window or packed layout (not an XLA fallback)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
from attnlayers.nnx import MultiHeadAttention
from tests import cases, reference
from tests.test_packing_core import check, minus_inf_bias, packed

pytestmark = pytest.mark.gpu
needs_te = cases.needs_te
BF16 = dict(dtype=jnp.bfloat16, head_dim=64, T=128, B=3)
CAUSAL_WINDOWS = {"left-only": (16, 0), "wider-than-T": (500, 0), "zero": (0, 0), "right-cut-by-causal": (7, 9)}
TE_WINDOWS = CAUSAL_WINDOWS | {"both-sides": (8, 5), "right-only": (0, 6)}


def compiled_text(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


def targets(text: str) -> set[str]:
  return set(re.findall(r'custom_call_target="([^"]*)"', text))


def grad_fn(backend, **kwargs):
  return jax.grad(lambda q, k, v: jnp.sum(attnlayers.attention(q, k, v, backend=backend, **kwargs)
                                          .astype(jnp.float32)), (0, 1, 2))


def qkv(heads="GQA", B=2, T=128, H=64):
  return cases.inputs(dict(heads=heads, causal=True, masked=False, dtype=jnp.bfloat16), B=B, T=T, S=T, H=H)[:3]


# cudnn: causal windows through local_window_size

@pytest.mark.parametrize("window", list(CAUSAL_WINDOWS))
@pytest.mark.parametrize("heads", list(cases.HEADS))
def test_cudnn_causal_window_matches_reference(heads, window):
  check("cudnn", heads, window=CAUSAL_WINDOWS[window], is_causal=True, **BF16)


def test_cudnn_causal_window_with_lengths_matches_reference():
  check("cudnn", "GQA", window=(16, 0), is_causal=True, q_len=[128, 90, 1], kv_len=[128, 100, 64], **BF16)


@pytest.mark.parametrize("backend", ["cudnn", pytest.param("te", marks=needs_te)])
def test_a_row_the_mask_and_causality_empty_together_outputs_zero(backend):
  """The kernels take the mask as a bias: a query whose only causal keys the mask drops would put all its weight
  on them (or average every key); the rule says zeros (tests/test_packing_core has the CPU backends' cases)."""
  mask = np.ones((3, 1, 128, 128), bool)
  mask[0, 0, 0, 0] = False  # row 0, query 0: causality leaves key 0 only
  mask[1, 0, 5, :6] = False  # row 1, query 5: keys 0-5
  empty = check(backend, "GQA", is_causal=True, mask=jnp.asarray(mask), **BF16)
  assert empty[0, 0].all() and empty[1, 5].all() and empty.sum() == 2 * empty.shape[-1]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", ["cudnn", pytest.param("te", marks=needs_te)])
def test_a_row_a_minus_inf_bias_empties_outputs_zero(backend, causal):
  """bias=jnp.where(mask, 0, -inf) reaches the kernels as a finite bias and a mask: a query whose keys are all at
  -inf outputs 0 with zero gradients, not the NaN of a softmax over -inf scores."""
  empty = check(backend, "GQA", is_causal=causal, bias=minus_inf_bias(3, 128, jnp.bfloat16), **BF16)
  assert empty[1, 2].all(), "the bias empties row 1's query 2"


def test_cudnn_window_runs_in_cudnn_with_its_band():
  q, k, v = qkv()
  text = compiled_text(grad_fn("cudnn", is_causal=True, window=(31, 0)), q, k, v)
  found = targets(text)
  assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= found, found
  assert re.search(r'sliding_window_length.{0,4}32\b', text), "cuDNN's band (left + 1 = 32) is not in the call"


REFUSED_BY_CUDNN = {
    "non-causal": (dict(window=(16, 16)), "only causal sliding windows"),
    "non-causal-left": (dict(window=(16, 0)), "#39576"),
    "segments": (dict(is_causal=True, segment_ids=jnp.ones((2, 128), jnp.int32)), "no segment ids"),
    "bottom-right": (dict(is_causal=True, window=(16, 0), causal_alignment="bottom-right",
                          key_value_seq_lengths=jnp.array([128, 64], jnp.int32)), "aligned top-left"),
}


@pytest.mark.parametrize("what", list(REFUSED_BY_CUDNN))
def test_cudnn_refuses_what_it_cannot_run_exactly(what):
  kwargs, reason = REFUSED_BY_CUDNN[what]
  q, k, v = qkv()
  plan = attnlayers.explain("cudnn", q, k, v, **kwargs)
  assert not plan.ok and any(reason in r for r in plan.unmet["cudnn"]), str(plan)
  with pytest.raises(attnlayers.BackendUnavailableError, match=re.escape(reason)):
    attnlayers.attention(q, k, v, backend="cudnn", **kwargs)


# te: packed documents in the THD layout, windows through window_size

@needs_te
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", list(cases.HEADS))
def test_te_segments_match_reference(heads, causal):
  ids = packed(3, 128, seed=4)  # one-token documents, padding tails, an all-padding row
  empty = check("te", heads, segment_ids=ids, is_causal=causal, **BF16)
  assert empty[-1].all()


@needs_te
def test_te_segments_with_a_tight_max_segments_match_reference():
  ids = packed(3, 128, seed=5)
  most = int(max(attnlayers.spec.count_runs(ids)))
  check("te", "GQA", segment_ids=ids, is_causal=True, max_segments=most, **BF16)


@needs_te
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", list(TE_WINDOWS))
def test_te_windows_match_reference(window, causal):
  check("te", "GQA", window=TE_WINDOWS[window], is_causal=causal, **BF16)


@needs_te
@pytest.mark.parametrize("heads", list(cases.HEADS))
def test_te_segments_and_causal_window_match_reference(heads):
  check("te", heads, segment_ids=packed(3, 128, seed=6), window=(5, 0), is_causal=True, **BF16)


@needs_te
def test_te_decode_step_with_a_window_matches_reference():
  """One query at the end of each row's keys (a KV-cache step): the window counts back from it."""
  check("te", "MQA", T=1, S=128, B=3, is_causal=True, alignment="bottom-right", window=(16, 0),
        q_len=[1, 1, 1], kv_len=[128, 40, 3], dtype=jnp.bfloat16, head_dim=64)


@needs_te
def test_te_packed_call_runs_te_kernels():
  q, k, v = qkv()
  ids = jnp.asarray(packed(2, 128, seed=7, padding_row=False))
  found = targets(compiled_text(grad_fn("te", is_causal=True, segment_ids=ids), q, k, v))
  assert any(t.startswith("te_fused_attn_forward") for t in found), found
  assert any(t.startswith("te_fused_attn_backward") for t in found), found


@needs_te
def test_te_rejects_ids_its_packed_layout_cannot_hold():
  """A document split in two runs (or ids that fall) is refused when known, NaN when traced; xla runs it."""
  q, k, v = qkv(B=1)
  ids = jnp.asarray(np.repeat([[1, 2, 1, 3]], 32, axis=0).T.reshape(1, 128), jnp.int32)  # doc 1 twice
  with pytest.raises(ValueError, match="one run of its id"):
    attnlayers.attention(q, k, v, backend="te", segment_ids=ids)
  out = jax.jit(lambda ids: attnlayers.attention(q, k, v, backend="te", segment_ids=ids))(ids)
  assert np.isnan(np.asarray(out, np.float32)).all()
  with pytest.raises(ValueError, match="more than max_segments=2"):
    attnlayers.attention(q, k, v, backend="te", segment_ids=ids, max_segments=2)


REFUSED_BY_TE = {
    "pair": (lambda ids: dict(segment_ids=(ids, ids + 0)), "one segment_ids array"),
    "lengths": (lambda ids: dict(segment_ids=ids, query_seq_lengths=jnp.array([128, 64], jnp.int32)), "segment id 0"),
    "mask": (lambda ids: dict(segment_ids=ids, mask=jnp.ones((2, 1, 128, 128), bool)), "no mask or bias"),
}


@needs_te
@pytest.mark.parametrize("what", list(REFUSED_BY_TE))
def test_te_refuses_what_its_packed_layout_cannot_express(what):
  q, k, v = qkv()
  kwargs, reason = REFUSED_BY_TE[what]
  kwargs = kwargs(jnp.ones((2, 128), jnp.int32))
  plan = attnlayers.explain("te", q, k, v, **kwargs)
  assert not plan.ok and any(reason in r for r in plan.unmet["te"]), str(plan)


# te-fp8: its FP8 core takes neither; fp8-or-bf16 runs TE's bf16 kernel, which does

@needs_te
def test_te_fp8_core_refuses_segments_and_windows_with_the_reason():
  q, k, v = qkv(T=256, H=128)
  for kwargs in (dict(window=(64, 0)), dict(segment_ids=jnp.ones((2, 256), jnp.int32))):
    plan = attnlayers.explain("te-fp8", q, k, v, is_causal=True, **kwargs)
    assert not plan.ok and "fp8-or-bf16" in str(plan) and "cuDNN FP8 attention does not run" in str(plan), str(plan)


@needs_te
def test_te_fp8_or_bf16_runs_packed_and_windowed_calls_on_te():
  q, k, v = qkv(T=256, H=128)
  ids = jnp.asarray(packed(2, 256, seed=9, padding_row=False))
  for kwargs in (dict(window=(64, 0)), dict(segment_ids=ids)):
    want = attnlayers.attention(q, k, v, backend="te", is_causal=True, **kwargs)
    got = attnlayers.attention(q, k, v, backend="te-fp8", is_causal=True, fp8_core="fp8-or-bf16", **kwargs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# the layer: segment_ids and sliding_window reach the kernel

@needs_te
def test_nnx_layer_packed_on_te_equals_xla():
  x = jax.random.normal(jax.random.key(0), (2, 128, 256), jnp.bfloat16)
  ids = jnp.asarray(packed(2, 128, seed=10))
  out = {}
  for backend in ("xla", "te"):
    layer = MultiHeadAttention(4, 256, num_kv_heads=2, backend=backend, is_causal=True, decode=False,
                               sliding_window=(32, 0), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    out[backend] = np.asarray(layer(x, segment_ids=ids), np.float32)
  reference.assert_close(out["te"], out["xla"], jnp.bfloat16, "out", "te layer vs xla layer, packed and windowed")


@needs_te
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_te_window_with_more_queries_than_keys_runs_exactly_or_is_refused(causal):
  """T > S, top-left: a left side as wide as S still cuts queries past it, so it is no 'unbounded' side."""
  q, k, v = cases.inputs(dict(heads="GQA", causal=causal, masked=False, dtype=jnp.bfloat16), B=2, T=256, S=128, H=64)[:3]
  plan = attnlayers.explain("te", q, k, v, is_causal=causal, window=(128, 0))
  if plan.ok:
    check("te", "GQA", T=256, S=128, B=2, window=(128, 0), is_causal=causal, dtype=jnp.bfloat16, head_dim=64)
  else:
    assert any("is_fused_attn_kernel_available" in r for r in plan.unmet["te"]), str(plan)


@needs_te
def test_te_segments_in_any_id_order_match_reference():
  ids = np.repeat([[5, 2, 9, 0]], 32, axis=0).T.reshape(1, 128).repeat(3, axis=0)  # ids fall and rise; a padding tail
  check("te", "MQA", segment_ids=ids.astype(np.int32), is_causal=True, **BF16)
