"""On an NVIDIA GPU: cudnn and auto for the bfloat16 matrix, and proof the fused kernel ran.

TransformerEngine backends (te, te-fp8): tests/test_gpu_te.py.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import attnlayers
from attnlayers.nnx import MultiHeadAttention
from tests import cases, reference

pytestmark = pytest.mark.gpu
GPU_SHAPE = dict(B=2, T=128, S=128, H=64)
CUDNN_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha[^"]*"')


def targets(fn, *args, pattern=CUDNN_FMHA) -> set[str]:
  """The fused-attention custom calls in the compiled HLO of fn(*args)."""
  return set(pattern.findall(jax.jit(fn).lower(*args).compile().as_text()))


@pytest.mark.parametrize("case", cases.matrix((jnp.bfloat16,)), ids=cases.case_id)
def test_cudnn_matches_reference(case):
  cases.check("cudnn", case, **GPU_SHAPE)


@pytest.mark.parametrize("case", cases.matrix((jnp.bfloat16,)), ids=cases.case_id)
def test_auto_is_cudnn_for_bf16(case):
  """auto's forward+backward lowers to exactly cudnn's program (its numbers are test_cudnn_matches_reference's)."""
  q, k, v, dout, mask = cases.inputs(case, **GPU_SHAPE)

  def program(backend):
    attend = lambda q, k, v: attnlayers.attention(q, k, v, backend=backend, is_causal=case["causal"], mask=mask)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * dout)
    return jax.jit(lambda q, k, v: (attend(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v))).lower(q, k, v).as_text()

  assert program("auto") == program("cudnn")
  assert program("auto") != program("xla")


@pytest.mark.parametrize("backend", ["cudnn", "auto"])
@pytest.mark.parametrize("causal, masked", [(False, False), (True, False), (True, True)])
def test_cudnn_kernel_is_in_compiled_hlo(backend, causal, masked):
  q, k, v, dout, mask = cases.inputs(dict(heads="GQA", causal=causal, masked=masked, dtype=jnp.bfloat16), **GPU_SHAPE)
  attend = lambda q, k, v: attnlayers.attention(q, k, v, backend=backend, is_causal=causal, mask=mask)
  forward = targets(attend, q, k, v)
  backward = targets(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * dout), (0, 1, 2)), q, k, v)
  assert forward and all("Backward" not in t for t in forward), forward
  assert any("Backward" in t for t in backward), backward


def test_xla_backend_does_not_use_cudnn_fmha():
  q, k, v, _, _ = cases.inputs(dict(heads="MHA", causal=True, masked=False, dtype=jnp.bfloat16), **GPU_SHAPE)
  attend = lambda backend: lambda q, k, v: attnlayers.attention(q, k, v, backend=backend, is_causal=True)
  assert targets(attend("cudnn"), q, k, v)  # the pattern finds the kernel where it is, so its absence means something
  assert not targets(attend("xla"), q, k, v)


def test_auto_chooses_cudnn_for_bf16_and_xla_for_float32():
  q, k, v, _, _ = cases.inputs(dict(heads="MQA", causal=True, masked=False, dtype=jnp.bfloat16), **GPU_SHAPE)
  assert attnlayers.explain("auto", q, k, v, is_causal=True).chosen == "cudnn"
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  plan = attnlayers.explain("auto", *f32, is_causal=True)
  assert plan.chosen == "xla" and "float32" in plan.unmet["cudnn"][0]


def test_cudnn_refuses_float32_and_large_head_dim():
  q = jnp.zeros((1, 128, 4, 64), jnp.float32)
  with pytest.raises(attnlayers.BackendUnavailableError, match="float16 or bfloat16"):
    attnlayers.attention(q, q, q, backend="cudnn")
  big = jnp.zeros((1, 128, 4, 512), jnp.bfloat16)
  with pytest.raises(attnlayers.BackendUnavailableError, match="head dim that is a multiple of 8"):
    attnlayers.attention(big, big, big, backend="cudnn")


def test_cudnn_layer_runs_the_fused_kernel_and_matches_reference():
  fused = MultiHeadAttention(8, 512, num_kv_heads=2, decode=False, backend="cudnn", is_causal=True,
                             dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 256, 512)).astype(jnp.bfloat16)
  graphdef, state = nnx.split(fused)
  assert targets(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
  want = cases.layer_reference(fused, x, is_causal=True)
  reference.assert_close(fused(x), want, jnp.bfloat16, what="cudnn layer vs float64 reference")


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_core_compiles_to_the_raw_kernels_program(causal):
  from benchmarks.wrapper import hlo_ops, programs
  ours, raw, args = programs("cudnn", causal, "fwd+bwd", (2, 1024, 4, 128))
  assert targets(ours, *args)  # the programs compared hold the kernel, so equal counts are not two empty ones
  assert hlo_ops(ours, *args) == hlo_ops(raw, *args)
