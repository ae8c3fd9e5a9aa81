"""The splash backend on a TPU: the compiled Pallas kernels, with the block table's own sizes.

Against the float64 reference, outputs and q/k/v gradients: MHA/GQA/MQA x causal x segment ids x windows x lengths,
bfloat16, head dims 128 and 64 (gpt2-small's). The compiled program holds the Pallas kernel (a tpu_custom_call),
not XLA's attention; auto picks splash for bfloat16; the nnx and Linen layers and the GPT run on it. One process
holds the chip: `python -m pytest -m tpu tests/test_tpu_splash.py -q -p no:cacheprovider`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
import models
from attnlayers import linen as our_linen
from attnlayers.backends import splash
from tests import cases, reference
from tests.test_packing_core import check, packed
from train.step import batch_loss

pytestmark = pytest.mark.tpu
BF16 = jnp.bfloat16

CASES = {  # check()'s arguments; T = S = 1024 unless given
    "MHA-causal": dict(heads="MHA", is_causal=True),
    "GQA-causal": dict(heads="GQA", is_causal=True),
    "MQA-causal": dict(heads="MQA", is_causal=True),
    "GQA-full": dict(heads="GQA"),
    "GQA-causal-segments": dict(heads="GQA", is_causal=True, segment_ids=packed(2, 1024, seed=1)),
    "MQA-segments": dict(heads="MQA", segment_ids=packed(2, 1024, seed=2)),
    "MHA-causal-window": dict(heads="MHA", is_causal=True, window=(200, 0)),
    "GQA-window-both-sides": dict(heads="GQA", window=(100, 300)),
    "GQA-causal-lengths": dict(heads="GQA", is_causal=True, q_len=[1024, 300], kv_len=[700, 1024]),
    "MQA-bottom-right-window": dict(heads="MQA", is_causal=True, T=512, S=1024, alignment="bottom-right",
                                    window=(256, 0)),
    "GQA-bottom-right-longer-queries": dict(heads="GQA", is_causal=True, S=512, alignment="bottom-right"),
    "MHA-everything": dict(heads="MHA", is_causal=True, window=(300, 0), segment_ids=packed(2, 1024, seed=3),
                           q_len=[1024, 600], kv_len=[1024, 800]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference(name):
  options = {"T": 1024, "B": 2, "dtype": BF16, "head_dim": 128} | CASES[name]
  check("splash", **options)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_head_dim_64_matches_the_reference(causal):
  check("splash", "GQA", T=512, B=2, dtype=BF16, head_dim=64, is_causal=causal)


def test_the_compiled_program_holds_the_pallas_kernel():
  q = jax.random.normal(jax.random.key(0), (2, 1024, 8, 128), BF16)
  kv = q[:, :, :2]

  def loss(q, k, v):
    return jnp.sum(attnlayers.attention(q, k, v, backend="splash", is_causal=True).astype(jnp.float32))

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
  calls = hlo.count('custom_call_target="tpu_custom_call"')
  kernels = 2 if splash.FUSED_BACKWARD else 3  # the forward, and dq with dk/dv in one kernel or two
  assert calls >= kernels, f"{kernels} kernels expected (forward and backward); {calls} tpu_custom_call in the program"


def test_auto_picks_splash_for_bfloat16_and_xla_for_float32():
  x = jax.ShapeDtypeStruct((2, 1024, 8, 128), BF16)
  plan = attnlayers.explain("auto", x, x, x, is_causal=True)
  assert plan.chosen == "splash" and any("splash blocks" in n for n in plan.notes), str(plan)
  x32 = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.float32)
  plan = attnlayers.explain("auto", x32, x32, x32, is_causal=True)
  assert plan.chosen == "xla" and any("bfloat16" in r for r in plan.unmet["splash"]), str(plan)


def test_the_nnx_layer_matches_the_reference_layer():
  layer = attnlayers.nnx.MultiHeadAttention(8, 1024, num_kv_heads=2, backend="splash", dtype=BF16, decode=False,
                                            is_causal=True, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 512, 1024), BF16)
  reference.assert_close(layer(x), cases.layer_reference(layer, x, is_causal=True), BF16, what="splash nnx layer")


def test_the_linen_layer_equals_its_xla_twin():
  x = jax.random.normal(jax.random.key(1), (2, 512, 1024), BF16)
  make = lambda backend: our_linen.MultiHeadDotProductAttention(num_heads=8, num_kv_heads=2, backend=backend, dtype=BF16,
                                                                 is_causal=True)
  params = make("xla").init(jax.random.key(0), x)
  got, want = (np.asarray(make(b).apply(params, x), np.float32) for b in ("splash", "xla"))
  np.testing.assert_allclose(got, want, **reference.tolerance(BF16))


def test_the_gpt_trains_on_splash_as_on_xla():
  """gpt2-small's head dim (64), packed rows: the loss on splash is xla's, and so is every parameter's gradient
  up to bfloat16 rounding (the cosine of the two, which a wrong gradient of any size fails, at least 0.99)."""
  cfg = models.preset("tiny", seq_len=512, n_head=2, n_kv_head=1, dtype="bfloat16")
  x = jax.random.randint(jax.random.key(1), (2, 512), 0, cfg.vocab_size)  # (B, T)
  batch = {"inputs": x, "targets": jnp.roll(x, -1, axis=1), "segment_ids": jnp.asarray(packed(2, 512, seed=4))}
  results = []
  for backend in ("splash", "xla"):
    graphdef, params, rest = nnx.split(models.GPT(dataclasses.replace(cfg, backend=backend), rngs=nnx.Rngs(0)),
                                       nnx.Param, ...)
    results.append(jax.jit(jax.value_and_grad(lambda p: batch_loss(graphdef, p, rest, batch, None)))(params))
  (loss, grads), (want, want_grads) = results
  reference.assert_close(loss, want, BF16, "out", "loss")
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
    if "['key']['bias']" in jax.tree_util.keystr(path):
      continue  # zero but for rounding: a bias on every key moves all of a query's scores alike
    g, w = (np.asarray(a, np.float64).ravel() for a in (g, w))
    cosine = g @ w / (np.linalg.norm(g) * np.linalg.norm(w))
    assert cosine >= 0.99, f"{jax.tree_util.keystr(path)}: cosine {cosine:.4f} between splash's and xla's gradient"
