"""Whole-model FP8 (backend "te-fp8"), on CPU: what can be checked without TransformerEngine.

The FP8 GEMMs themselves run on the GPU (tests/test_gpu_te.py). Here: the parameter tree is
Flax's for every backend (one checkpoint, every backend), the FP8 state covers the fused
q/k/v GEMM, the output projection and both MLP GEMMs, the fused q/k/v GEMM computes what the
three projections compute, and a machine without TE refuses with its reasons.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from attnlayers.device import has_module
from attnlayers.fp8 import FP8Meta, FP8Unavailable
from attnlayers.flax_attention import BackendAttention
from attnlayers.nnx import MultiHeadAttention
from tests import reference

D = 32  # model width


def tiny(backend: str, **overrides) -> models.GPTConfig:
  return models.preset("tiny", backend=backend, n_layer=2, dtype="bfloat16", **overrides)


@pytest.mark.parametrize("bias", [True, False])
def test_te_fp8_gpt_keeps_the_parameter_tree_and_adds_fp8_state_to_every_block_gemm(bias):
  fp8_model = models.GPT(tiny("te-fp8", bias=bias), rngs=nnx.Rngs(0))
  plain = models.GPT(tiny("cudnn", bias=bias), rngs=nnx.Rngs(0))
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(fp8_model, nnx.Param)),
               nnx.to_pure_dict(nnx.state(plain, nnx.Param)))  # same names, shapes and values
  meta = nnx.to_pure_dict(nnx.state(fp8_model, FP8Meta))
  for block in meta["blocks"].values():
    assert set(block) == {"attn", "fc", "proj"}, set(block)
    assert set(block["attn"]) == {"fp8_qkv", "out", "fp8_core"}, set(block["attn"])  # fp8_core: the core's history
  assert "head" not in meta and "wte" not in meta  # the logits head stays bf16
  assert not nnx.state(plain, FP8Meta)


@pytest.mark.skipif(has_module("transformer_engine") and jax.default_backend() == "gpu",
                    reason="TransformerEngine and a GPU are both here, so te-fp8 runs (tests/test_gpu_te.py checks it)")
def test_te_fp8_gpt_refuses_without_a_gpu_and_transformer_engine():
  model = models.GPT(tiny("te-fp8"), rngs=nnx.Rngs(0))
  with pytest.raises(FP8Unavailable) as err:
    model(jnp.zeros((1, 8), jnp.int32))
  assert any("TransformerEngine is not installed" in r or "NVIDIA GPU" in r for r in err.value.reasons), err.value


class PlainDot(nnx.Module):
  """A dot_general in the fused GEMM's place, so the fusion's arithmetic runs on CPU; records its shapes."""

  def __init__(self):
    self.kernel_shapes = []

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, **kwargs):
    self.kernel_shapes.append(rhs.shape)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision)


@pytest.mark.parametrize("kv_heads, use_bias", [(4, True), (2, True), (1, False)], ids=["MHA", "GQA", "MQA-nobias"])
def test_fused_qkv_gemm_computes_the_three_projections(kv_heads, use_bias):
  kw = dict(num_kv_heads=kv_heads, use_bias=use_bias, decode=False, is_causal=True)
  fused = MultiHeadAttention(4, D, backend="te-fp8", **kw, rngs=nnx.Rngs(0))
  plain = MultiHeadAttention(4, D, backend="xla", **kw, rngs=nnx.Rngs(0))
  fused.fp8_qkv = nnx.data(PlainDot())
  fused.out.dot_general = jax.lax.dot_general
  fused.attention_fn = BackendAttention("xla")  # the core is not what this test is about
  fused.fp8_core = None  # nor the FP8 core's amax history, which only te-fp8 takes
  x = jax.random.normal(jax.random.key(1), (2, 8, D))
  reference.assert_close(fused(x), plain(x), jnp.float32, "out", "fused q/k/v GEMM vs three projections")
  assert fused.fp8_qkv.kernel_shapes == [(D, (4 + 2 * kv_heads) * D // 4)]  # one GEMM: (D, (N + 2K) H)
  grads = [nnx.to_pure_dict(nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)) for m in (fused, plain)]
  for name in ("query", "key", "value"):
    reference.assert_close(grads[0][name]["kernel"], grads[1][name]["kernel"], jnp.float32, "grad", f"d{name}")


def test_te_fp8_layer_refuses_cross_attention_and_names_what_works():
  layer = MultiHeadAttention(4, D, backend="te-fp8", decode=False, rngs=nnx.Rngs(0))
  x, y = jnp.ones((1, 8, D)), jnp.zeros((1, 6, D))
  with pytest.raises(ValueError, match="one FP8 GEMM.*use backend='te'"):
    layer(x, y)
