"""On an NVIDIA GPU with TransformerEngine: te and te-fp8 against the float64 reference, and
proof in the compiled HLO that the TE and FP8 kernels ran."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
from attnlayers.fp8 import FP8Meta, FP8Recipe
from attnlayers.nnx import MultiHeadAttention
from tests import cases, reference

pytestmark = [pytest.mark.gpu,
              cases.needs_te]
GPU_SHAPE = dict(B=2, T=128, S=128, H=64)
FP8_SHAPE = dict(B=2, T=256, S=256, H=128)  # what cuDNN's FP8 attention takes: H 128, T and S multiples of 128
UNMASKED = [c for c in cases.matrix((jnp.bfloat16,)) if not c["masked"]]


def custom_calls(fn, *args) -> list[str]:
  """Every custom-call line of the compiled HLO of fn(*args)."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  return [line for line in text.splitlines() if "custom_call_target=" in line]


def targets(lines) -> set[str]:
  return {m for line in lines for m in re.findall(r'custom_call_target="([^"]*)"', line)}


def grad_of(backend, causal, dout, mask=None):
  attend = lambda q, k, v: attnlayers.attention(q, k, v, backend=backend, is_causal=causal, mask=mask)
  return attend, jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * dout), (0, 1, 2))


@pytest.mark.parametrize("case", cases.matrix((jnp.bfloat16,)), ids=cases.case_id)
def test_te_matches_reference(case):
  cases.check("te", case, **GPU_SHAPE)


@pytest.mark.parametrize("masked", [False, True])
def test_te_kernel_is_in_compiled_hlo(masked):
  q, k, v, dout, mask = cases.inputs(dict(heads="GQA", causal=True, masked=masked, dtype=jnp.bfloat16), **GPU_SHAPE)
  _, grad = grad_of("te", True, dout, mask)
  found = targets(custom_calls(grad, q, k, v))
  assert any(t.startswith("te_fused_attn_forward") for t in found), found
  assert any(t.startswith("te_fused_attn_backward") for t in found), found


@pytest.mark.parametrize("case", UNMASKED, ids=cases.case_id)
def test_te_fp8_core_matches_reference(case):
  cases.check("te-fp8", case, tolerance="fp8", **FP8_SHAPE)  # the exact reference, within FP8_FRACTION_OF_MAX
  q, k, v, dout, _ = cases.inputs(case, **FP8_SHAPE)
  attend, grad = grad_of("te-fp8", case["causal"], dout)
  out, grads = jax.jit(attend)(q, k, v), jax.jit(grad)(q, k, v)
  # the reference on q, k, v as the core quantises them, within FP8_QUANTISED: refuses a 1.1x output or gradient
  reference.check_fp8_core(out, grads, q, k, v, dout, is_causal=case["causal"], what="te-fp8 core")


def test_fp16_output_of_a_tiny_v_is_dequantised_in_float32():
  """Current scaling, max|v| ~ 4e-6: O's scale is then ~2^24, whose inverse fp16 cannot hold; O must still be v's size."""
  case = dict(heads="GQA", causal=True, masked=False, dtype=jnp.float16)
  q, k, v, _, _ = cases.inputs(case, **FP8_SHAPE)
  tiny = 2.0 ** -20
  out = jax.jit(lambda q, k, v: attnlayers.attention(q, k, v, backend="te-fp8", is_causal=True))(
      q, k, (v.astype(jnp.float32) * tiny).astype(jnp.float16))
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  want, _ = reference.forward(f64(q), f64(k), f64(v), is_causal=True)  # v unscaled: compare O / tiny
  reference.assert_close(np.asarray(out, np.float64) / tiny, want, "fp8", "out", "fp16 core, max|v| ~ 4e-6")


def test_te_fp8_core_runs_cudnn_fp8_forward_and_bf16_backward():
  q, k, v, dout, _ = cases.inputs(dict(heads="GQA", causal=True, masked=False, dtype=jnp.bfloat16), **FP8_SHAPE)
  attend, grad = grad_of("te-fp8", True, dout)
  assert "__cudnn$fmhaSoftmaxF8" in targets(custom_calls(attend, q, k, v))
  lines = custom_calls(grad, q, k, v)
  assert {"__cudnn$fmhaSoftmaxF8", "__cudnn$fmhaSoftmaxBackward"} <= targets(lines), targets(lines)
  fp8_call = next(line for line in lines if '"__cudnn$fmhaSoftmaxF8"' in line)
  assert "f8e4m3fn" in fp8_call, fp8_call  # the kernel's q/k/v operands are E4M3


NOT_FP8 = [dict(heads="GQA", causal=True, masked=True, dtype=jnp.bfloat16),  # a mask, head dim 64
           dict(heads="MHA", causal=False, masked=False, dtype=jnp.bfloat16)]  # head dim 64


@pytest.mark.parametrize("case", NOT_FP8, ids=cases.case_id)
def test_te_fp8_refuses_a_call_its_fp8_core_cannot_take_by_default(case):
  q, k, v, _, mask = cases.inputs(case, **GPU_SHAPE)
  plan = attnlayers.explain("te-fp8", q, k, v, is_causal=case["causal"], mask=mask)
  assert not plan.ok and plan.chosen is None
  assert any("head dim 128" in r for r in plan.unmet["te-fp8"]) and "fp8_core='fp8-or-bf16'" in str(plan), str(plan)
  with pytest.raises(attnlayers.BackendUnavailableError, match="fp8_core='fp8'"):
    attnlayers.attention(q, k, v, backend="te-fp8", is_causal=case["causal"], mask=mask)


@pytest.mark.parametrize("mode", ["fp8-or-bf16", "bf16"])
@pytest.mark.parametrize("case", NOT_FP8, ids=cases.case_id)
def test_te_fp8_runs_bf16_core_only_when_told_and_says_why(case, mode):
  q, k, v, dout, mask = cases.inputs(case, **GPU_SHAPE)  # head dim 64: not an FP8 shape
  causal = case["causal"]
  plan = attnlayers.explain("te-fp8", q, k, v, is_causal=causal, mask=mask, fp8_core=mode)
  assert plan.chosen == "te-fp8", str(plan)
  assert any(n.startswith("core: TransformerEngine bf16 fused attention") and f"'{mode}'" in n for n in plan.notes), plan.notes
  lines = custom_calls(lambda q, k, v: attnlayers.attention(q, k, v, backend="te-fp8", is_causal=causal, mask=mask,
                                                            fp8_core=mode), q, k, v)
  assert any(t.startswith("te_fused_attn_forward") for t in targets(lines)), targets(lines)
  out = attnlayers.attention(q, k, v, backend="te-fp8", is_causal=causal, mask=mask, fp8_core=mode)
  f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  want, _ = reference.forward(f64(q), f64(k), f64(v), mask=None if mask is None else np.asarray(mask), is_causal=causal)
  reference.assert_close(out, want, jnp.bfloat16, "out", f"te-fp8 {mode} core")  # bf16 tolerance: the bf16 kernel


def test_te_fp8_bf16_mode_keeps_a_qualifying_call_in_bf16():
  q, k, v, _, _ = cases.inputs(dict(heads="MHA", causal=True, masked=False, dtype=jnp.bfloat16), **FP8_SHAPE)
  attend = lambda q, k, v: attnlayers.attention(q, k, v, backend="te-fp8", is_causal=True, fp8_core="bf16")
  found = targets(custom_calls(attend, q, k, v))
  assert "__cudnn$fmhaSoftmaxF8" not in found and any(t.startswith("te_fused_attn_forward") for t in found), found


def test_te_fp8_explain_names_the_fp8_core():
  q, k, v, _, _ = cases.inputs(dict(heads="MHA", causal=True, masked=False, dtype=jnp.bfloat16), **FP8_SHAPE)
  plan = attnlayers.explain("te-fp8", q, k, v, is_causal=True)
  assert plan.chosen == "te-fp8" and "cuDNN FP8" in str(plan), str(plan)


def _layers(recipe=None):
  make = lambda backend, **kw: MultiHeadAttention(4, 512, decode=False, backend=backend, is_causal=True,
                                                  dtype=jnp.bfloat16, rngs=nnx.Rngs(0), **kw)
  return make("te-fp8", fp8_recipe=recipe), make("te")


@pytest.mark.parametrize("recipe", [FP8Recipe(), FP8Recipe(kind="current")], ids=["delayed", "current"])
def test_te_fp8_layer_gemms_and_core_run_in_fp8(recipe):
  fp8_layer, te_layer = _layers(recipe)
  x = jax.random.normal(jax.random.key(1), (2, 256, 512)).astype(jnp.bfloat16)
  same_tree = jax.tree.structure(nnx.state(fp8_layer, nnx.Param)) == jax.tree.structure(nnx.state(te_layer, nnx.Param))
  assert same_tree, "te-fp8 must keep Flax's parameter tree"
  graphdef, params, meta = nnx.split(fp8_layer, nnx.Param, FP8Meta)
  loss = lambda p, m, x: jnp.sum(nnx.merge(graphdef, p, m)(x).astype(jnp.float32) ** 2)
  lines = custom_calls(jax.grad(loss, argnums=(0, 1)), params, meta, x)
  gemms = [line for line in lines if re.search(r'custom_call_target="[^"]*(gemm|matmul)[^"]*"', line)]
  assert any("f8e4m3fn" in line for line in gemms), targets(lines)  # FP8 projections
  assert "__cudnn$fmhaSoftmaxF8" in targets(lines)  # FP8 attention core
  # A delayed-scaling step's first outputs equal current scaling's within FP8 error, vs the bf16 te layer.
  reference.assert_close(fp8_layer(x), te_layer(x), "fp8", what="te-fp8 layer vs te layer")


def test_te_fp8_delayed_scaling_state_is_updated_by_the_gradient():
  fp8_layer, _ = _layers()
  x = jax.random.normal(jax.random.key(1), (2, 256, 512)).astype(jnp.bfloat16)
  graphdef, params, meta = nnx.split(fp8_layer, nnx.Param, FP8Meta)
  loss = lambda p, m: jnp.sum(nnx.merge(graphdef, p, m)(x).astype(jnp.float32) ** 2)
  _, new = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, meta)
  flat = {"/".join(map(str, path)): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(new)}
  # (fused q/k/v, out) x (x, kernel, grad) x (scale, amax_history), and the core's q/k/v history
  assert len(flat) == 2 * 3 * 2 + 1, sorted(flat)
  for name, value in flat.items():
    if "amax_history" in name or "fp8_core" in name:
      assert value.max() > 0, f"{name}: no amax recorded"
    else:
      assert np.isfinite(value).all() and value[0] != 1.0, f"{name}: scale not updated ({value})"


@pytest.mark.parametrize("causal", [False, True])
def test_te_core_compiles_to_the_raw_kernels_program(causal):
  from benchmarks.wrapper import hlo_ops, programs
  ours, raw, args = programs("te", causal, "fwd+bwd", (2, 1024, 4, 128))
  assert hlo_ops(ours, *args) == hlo_ops(raw, *args)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_te_from_linen_equals_te_from_nnx(kv_heads):
  import attnlayers.linen as al
  x = jax.random.normal(jax.random.key(1), (2, 128, 256)).astype(jnp.bfloat16)
  mask = jax.random.bernoulli(jax.random.key(2), 0.7, (2, 1, 128, 128)).at[..., 0].set(True)
  layer = MultiHeadAttention(4, 256, num_kv_heads=kv_heads, decode=False, backend="te", dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
  linen_layer = al.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=kv_heads, backend="te", dtype=jnp.bfloat16)
  np.testing.assert_array_equal(linen_layer.apply({"params": params}, x, mask=mask, is_causal=True),
                                layer(x, mask=mask, is_causal=True))
