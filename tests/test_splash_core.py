"""The splash backend on a CPU: its Pallas kernels through Pallas's interpreter, against the float64 reference.

MHA/GQA/MQA x causal x segment ids x windows x lengths x bottom-right, outputs and q/k/v gradients, exact zeros
(and zero dq) for queries with no key; the kernel cache; what auto picks; and every refusal with its reason.
Blocks of 128 here, so rows of 256 span several blocks and the kernel skips the empty ones. The compiled kernels
on a TPU: tests/test_tpu_splash.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
from attnlayers import device as device_lib
from attnlayers.backends import splash
from tests import cases, reference
from tests.test_packing_core import check, packed

BF16 = jnp.bfloat16
CPU = device_lib.DeviceInfo("cpu", "cpu", None, None)  # what a call on a CPU sees, on any machine


@pytest.fixture
def interpreted(monkeypatch):
  """splash runs here, interpreted, with blocks of 128."""
  monkeypatch.setattr(splash, "_INTERPRET", True)
  for table in ("Q_BLOCKS", "KV_BLOCKS", "KV_COMPUTE_BLOCKS"):
    monkeypatch.setattr(splash, table, (128,))


CASES = {  # check()'s arguments; T = S = 256 unless given
    "MHA-causal": dict(heads="MHA", is_causal=True),
    "GQA-segments": dict(heads="GQA", segment_ids=packed(2, 256, seed=1)),
    "MQA-causal-window": dict(heads="MQA", is_causal=True, window=(40, 0)),
    "GQA-causal-lengths": dict(heads="GQA", is_causal=True, q_len=[256, 100], kv_len=[200, 256]),
    # 256 queries at the end of 128 keys: the first query block has no key block (the kernel leaves it NaN)
    "GQA-bottom-right": dict(heads="GQA", is_causal=True, S=128, alignment="bottom-right"),
    "MHA-window-segments-lengths": dict(heads="MHA", window=(20, 30), segment_ids=packed(2, 256, seed=3),
                                        q_len=[256, 100], kv_len=[256, 180]),
    "MQA-causal-segments-pair-bottom-right": dict(
        heads="MQA", is_causal=True, T=128, S=256, alignment="bottom-right", window=(60, 0),
        segment_ids=(packed(2, 256, seed=4, padding_row=False)[:, -128:], packed(2, 256, seed=4, padding_row=False))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference(interpreted, name):
  options = {"T": 256, "B": 2, "dtype": BF16, "head_dim": 64} | CASES[name]
  check("splash", **options)


def test_fused_backward_matches_the_reference(interpreted, monkeypatch):
  monkeypatch.setattr(splash, "FUSED_BACKWARD", True)
  check("splash", "GQA", T=256, B=1, dtype=BF16, head_dim=128, is_causal=True, segment_ids=packed(1, 256, seed=5,
                                                                                                  padding_row=False))


def test_a_kernel_is_built_once_per_shape_and_mask(interpreted):
  q = jax.random.normal(jax.random.key(0), (1, 256, 2, 64), BF16)
  run = lambda q, causal: attnlayers.attention(q, q[:, :, :1], q[:, :, :1], backend="splash", is_causal=causal)
  splash._kernel.cache_clear()
  for fn in (functools.partial(run, causal=True), lambda q: run(q * 2, True)):  # two traces, one kernel
    jax.eval_shape(fn, q)
  assert splash._kernel.cache_info().misses == 1
  jax.eval_shape(functools.partial(run, causal=False), q)
  assert splash._kernel.cache_info().misses == 2  # another mask, another kernel


def test_plan_names_the_blocks_and_the_mask(interpreted):
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), BF16)
  kv = jax.ShapeDtypeStruct((2, 384, 1, 64), BF16)
  plan = attnlayers.explain("splash", q, kv, kv, is_causal=True, causal_alignment="bottom-right", window=(64, 0),
                            segment_ids=(jnp.ones((2, 256), jnp.int32),
                                                                 jnp.ones((2, 384), jnp.int32)))
  assert plan.decision.blocks == splash.Blocks(128, 128, 128, splash.FUSED_BACKWARD) and plan.decision.offset == 128, plan
  assert "splash blocks: q 128, kv 128" in str(plan) and "window (left, right) = (64, 0) at offset 128" in str(plan)


@pytest.mark.parametrize("causal, window, mask", [
    (False, None, ("full", None)), (True, None, ("causal", None)), (False, (10**6, 10**6), ("full", None)),
    (True, (10**6, 5), ("causal", None)), (False, (10**6, 0), ("causal", None)), (True, (7, 5), ("local", (7, 0))),
    (False, (7, 10**6), ("local", (7, None)))])
def test_the_kernel_mask_of_causality_and_windows(interpreted, causal, window, mask):
  """A side of the window that reaches every key is no bound; with causality the right side is cut at p."""
  x = jax.ShapeDtypeStruct((1, 256, 2, 64), BF16)
  d = attnlayers.explain("splash", x, x, x, is_causal=causal, window=window).decision
  assert (d.mask, d.window) == mask


def test_the_block_table_takes_the_largest_block_that_divides():
  assert splash.blocks(1024, 4096) == splash.Blocks(1024, 1024, 1024, splash.FUSED_BACKWARD)
  assert splash.blocks(384, 640) == splash.Blocks(128, 128, 128, splash.FUSED_BACKWARD)
  assert splash.blocks(512, 768).q == 512 and splash.blocks(512, 768).kv == 256


def test_auto_picks_splash_for_bfloat16_where_it_runs(interpreted, monkeypatch):
  x = jax.ShapeDtypeStruct((2, 256, 4, 64), BF16)
  plan = attnlayers.explain("auto", x, x, x, is_causal=True)
  assert plan.chosen == "splash" and "first of cudnn, splash, xla, naive" in str(plan), str(plan)
  plan = attnlayers.explain("auto", x, x, x, is_causal=True, bias=jnp.zeros((256, 256), BF16))
  assert plan.chosen == "xla" and "takes no mask= or bias= array" in str(plan), str(plan)
  monkeypatch.setattr(splash, "_INTERPRET", False)
  monkeypatch.setattr(device_lib, "of", lambda *arrays: CPU)
  plan = attnlayers.explain("auto", x, x, x, is_causal=True)
  assert plan.chosen == "xla" and any("device is cpu" in r for r in plan.unmet["splash"]), str(plan)


def test_auto_on_a_gpu_is_unchanged(monkeypatch):
  monkeypatch.setattr(device_lib, "of", lambda *arrays: device_lib.DeviceInfo("gpu", "NVIDIA H200", (9, 0), 91900))
  x = jax.ShapeDtypeStruct((2, 256, 4, 64), BF16)
  plan = attnlayers.explain("auto", x, x, x, is_causal=True)
  assert plan.chosen == "cudnn" and plan.unmet == {}, str(plan)


X = jax.ShapeDtypeStruct((2, 256, 4, 64), BF16)
REFUSED = {  # explain()'s arguments -> a phrase of the reason
    "float32": (dict(q=jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.float32)), "runs bfloat16 q/k/v"),
    "float16": (dict(q=jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.float16)), "got float16"),
    "T-not-multiple-of-128": (dict(q=jax.ShapeDtypeStruct((2, 200, 4, 64), BF16)), "got T=200, S=256"),
    "decode-step": (dict(q=jax.ShapeDtypeStruct((2, 1, 4, 64), BF16)), "a one-token decode step"),
    "mask": (dict(mask=jnp.ones((256, 256), bool)), "takes no mask= or bias= array"),
    "bias": (dict(bias=jnp.zeros((256, 256), BF16)), "takes no mask= or bias= array"),
    "dropout": (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "no dropout"),
    "weights": (dict(return_weights=True), "cannot return or sow them"),
    "precision": (dict(precision=jax.lax.Precision.HIGHEST), "cannot apply precision"),
    "bottom-right-lengths": (dict(is_causal=True, causal_alignment="bottom-right",
                                  key_value_seq_lengths=jnp.array([256, 100])), "one offset for every row"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_what_it_cannot_run_with_the_reason(interpreted, name):
  options, reason = REFUSED[name]
  q = options.pop("q", X)
  k = jax.ShapeDtypeStruct((2, 256, 4, 64), q.dtype)
  plan = attnlayers.explain("splash", q, k, k, **options)
  assert not plan.ok and any(reason in r for r in plan.unmet["splash"]), str(plan)
  assert len(plan.unmet["splash"]) == 1, str(plan)  # that reason alone


def test_refuses_off_a_tpu_and_attention_raises(monkeypatch):
  monkeypatch.setattr(device_lib, "of", lambda *arrays: CPU)
  x = jnp.zeros((1, 128, 2, 64), BF16)
  with pytest.raises(attnlayers.BackendUnavailableError, match="Pallas kernels for TPU; the call's device is cpu"):
    attnlayers.attention(x, x, x, backend="splash")


def test_a_layer_runs_splash_and_its_kv_cache_decode_says_what_runs_it(interpreted):
  """The nnx layer on backend="splash" matches the float64 layer; decoding with it refuses, naming 'xla'."""
  layer = attnlayers.nnx.MultiHeadAttention(4, 256, num_kv_heads=2, backend="splash", dtype=BF16, decode=False,
                                            is_causal=True, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (1, 128, 256), BF16)
  want = cases.layer_reference(layer, x, is_causal=True)
  reference.assert_close(layer(x), want, BF16, what="splash layer")
  layer.init_cache(x.shape, dtype=BF16)
  with pytest.raises(attnlayers.BackendUnavailableError, match="a KV cache's prefill and decode steps.*'xla'"):
    layer(x[:, :1], decode=True)
