"""The rule te-fp8's FP8 core is held to on the GPU (tests/reference.py: check_fp8_core, FP8_QUANTISED), on CPU:
it accepts what an FP8 kernel computes from its quantised inputs and refuses an output or gradient 1.1x too large.

The kernel is emulated in numpy the way cuDNN's FP8 forward and the bf16 backward after it run: q, k, v
quantised to E4M3 with per-tensor power-of-two scales, the scores and softmax exact, P rounded to E4M3 at scale
448 (normalised, or as exp(s - max) divided by its row sum after P.V: either order), O rounded to E4M3 at scale
sv / 2 and then to bf16; the backward exact on the dequantised q, k, v except that it takes the FP8 output into
rowsum(dout * O), and its gradients rounded to bf16.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests import cases, reference

SHAPE = dict(B=2, T=256, S=256, H=128)  # the GPU tests' FP8 shape
UNMASKED = [c for c in cases.matrix((jnp.bfloat16,)) if not c["masked"]]


def _bf16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _emulated_core(q, k, v, dout, *, is_causal, p_normalised=True, scales=(None,) * 3):
  """(out (B, T, N, H), (dq, dk, dv)) in bf16-rounded float64, as the FP8 core computes them (module docstring),
  and the same from the float64 reference on the quantised inputs."""
  x = [reference.fp8_quantised(t, s) for t, s in zip((q, k, v), scales)]  # dequantised q, k, v
  want, p = reference.forward(*x, is_causal=is_causal)  # (B, T, N, H), (B, N, T, S)
  (B, T, N, H), K = q.shape, k.shape[2]
  vx = np.repeat(x[2], N // K, axis=2).transpose(0, 2, 1, 3)  # (B, N, S, H)
  if p_normalised:
    o = reference.fp8_quantised(p, 448.0) @ vx
  else:  # exp(s - max) is p / max(p) in [0, 1]; the row sum divides after P.V
    top = p.max(-1, keepdims=True)
    o = (reference.fp8_quantised(p / top, 448.0) @ vx) * top
  sv = scales[2] or reference.fp8_scale(np.abs(np.asarray(v, np.float32)).max())
  out = _bf16(reference.fp8_quantised(o, sv / 2)).transpose(0, 2, 1, 3)  # (B, T, N, H)
  want_grads = reference.gradients(*x, np.asarray(dout, np.float64), is_causal=is_causal)
  dq, dk, dv = want_grads
  # the backward's D = rowsum(dout * O) takes the FP8 O, so ds = p * (dp - D) moves by -p * dD
  dD = np.sum(np.asarray(dout, np.float64) * (out - want), -1).transpose(0, 2, 1)[..., None]  # (B, N, T, 1)
  dds = -p * dD * H**-0.5  # (B, N, T, S), the softmax scale folded in
  kx, qx = (np.repeat(x[1], N // K, axis=2).transpose(0, 2, 1, 3), x[0].transpose(0, 2, 1, 3))  # (B, N, S|T, H)
  dq = dq + (dds @ kx).transpose(0, 2, 1, 3)
  dk = dk + (dds.transpose(0, 1, 3, 2) @ qx).reshape(B, K, N // K, -1, H).sum(2).transpose(0, 2, 1, 3)
  return (out, tuple(_bf16(g) for g in (dq, dk, dv))), (want, want_grads)


# every head layout, causal, and GQA without causality, with P rounded normalised; GQA with the other order
GQA = [case for case in UNMASKED if case["heads"] == "GQA"]
KERNELS = [(case, True) for case in UNMASKED if case["causal"] or case in GQA] + [(case, False) for case in GQA]


@pytest.mark.parametrize("case, p_normalised", KERNELS,
                         ids=[f"{cases.case_id(c)}-P-{'normalised' if n else 'unnormalised'}" for c, n in KERNELS])
def test_fp8_rule_accepts_the_kernels_rounding_and_refuses_a_tenth_too_much(case, p_normalised):
  q, k, v, dout, _ = cases.inputs(case, **SHAPE)
  causal = case["causal"]
  (out, grads), (want, want_grads) = _emulated_core(q, k, v, dout, is_causal=causal, p_normalised=p_normalised)
  reference.check_fp8_core(out, grads, q, k, v, dout, is_causal=causal, what="emulated FP8 core")
  for factor in (1.1, 0.9):
    pairs = [(out, want, "out", "output"), *zip(grads, want_grads, ["grad"] * 3, ["dq", "dk", "dv"])]
    for got, ref, kind, name in pairs:
      with pytest.raises(AssertionError, match="FP8_QUANTISED"):
        reference.assert_fp8_matches_quantised(factor * got, ref, kind, f"{factor} x {name}")


def test_fp8_rule_accepts_the_quantised_reference_itself():
  case = dict(heads="GQA", causal=True, masked=False, dtype=jnp.bfloat16)
  q, k, v, dout, _ = cases.inputs(case, **SHAPE)
  x = [reference.fp8_quantised(t) for t in (q, k, v)]
  want, _ = reference.forward(*x, is_causal=True)
  reference.check_fp8_core(want, reference.gradients(*x, np.asarray(dout), is_causal=True), q, k, v, dout,
                           is_causal=True, what="the quantised reference")


def test_fp8_rule_follows_the_cores_scales_and_saturation():
  """Delayed scaling from amaxes 16x too small saturates q, k and v: the reference quantises with the scales it is
  given, so the saturated core passes against them, and fails against current scaling's."""
  case = dict(heads="GQA", causal=True, masked=False, dtype=jnp.bfloat16)
  q, k, v, dout, _ = cases.inputs(case, **SHAPE)
  scales = [reference.fp8_scale(np.abs(np.asarray(x, np.float32)).max() / 16) for x in (q, k, v)]
  (out, grads), _ = _emulated_core(q, k, v, dout, is_causal=True, scales=scales)
  reference.check_fp8_core(out, grads, q, k, v, dout, is_causal=True, scales=scales, what="saturated core")
  with pytest.raises(AssertionError, match="FP8_QUANTISED"):
    reference.check_fp8_core(out, grads, q, k, v, dout, is_causal=True, what="saturated core, current scales")


def test_fp8_quantised_rounds_to_e4m3_and_saturates():
  x = np.array([1.0, 1.0625, 1.07, 3.0, -500.0, 2.0**-9, 2.0**-11], np.float32)
  np.testing.assert_array_equal(reference.fp8_quantised(x, 1.0), [1.0, 1.0, 1.125, 3.0, -448.0, 2.0**-9, 0.0])
  assert reference.fp8_scale(3.0) == 128.0 and reference.fp8_scale(448.0) == 1.0 and reference.fp8_scale(0.0) == 1.0
  scaled = reference.fp8_quantised(np.array([3.0, 0.01], np.float32))  # scale 128: 0.01 * 128 = 1.28 -> 1.25
  np.testing.assert_array_equal(scaled, [3.0, 1.25 / 128])
