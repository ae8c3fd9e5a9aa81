"""On an NVIDIA GPU with TransformerEngine: te-fp8's delayed-scaling FP8 core on cuDNN's kernels against
the float64 reference, the history its gradient hands back, saturation, and the te-fp8 layer advancing
its core history in a training step (tests/test_fp8_delayed.py checks the same logic on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
from attnlayers.backends import _fp8_delayed
from attnlayers.fp8 import FP8Meta
from attnlayers.nnx import MultiHeadAttention
from tests import cases, reference

pytestmark = [pytest.mark.gpu,
              cases.needs_te]
SHAPE = dict(B=2, T=256, S=256, H=128)  # what cuDNN's FP8 attention takes
UNMASKED = [c for c in cases.matrix((jnp.bfloat16,)) if not c["masked"]]


def _amax(*xs):
  return jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in xs])  # (3,)


def _run(case, q, k, v, history, dout):
  def loss(q, k, v, h):
    out = attnlayers.attention(q, k, v, backend="te-fp8", is_causal=case["causal"], fp8_amax_history=h)
    return jnp.sum(out.astype(jnp.float32) * dout), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, history)


def _scales(history):
  """The core's (sq, sk, sv) from a (3, L) history, by the reference's own rule: 1 for a row with nothing measured."""
  return [reference.fp8_scale(amax) for amax in np.asarray(history).max(axis=1)]


def _check(case, got_out, got_grads, q, k, v, dout, scales, what):
  """Against the exact reference (FP8_FRACTION_OF_MAX), and against the reference on q, k, v quantised with the
  core's scales (FP8_QUANTISED, which refuses an output or gradient 1.1x too large)."""
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  options = dict(is_causal=case["causal"])
  want, _ = reference.forward(f64(q), f64(k), f64(v), **options)
  reference.assert_close(got_out, want, "fp8", "out", what)
  for name, got, ref in zip("qkv", got_grads, reference.gradients(f64(q), f64(k), f64(v), np.asarray(dout), **options)):
    reference.assert_close(got, ref, "fp8", "grad", f"{what} d{name}")
  reference.check_fp8_core(got_out, got_grads, q, k, v, dout, is_causal=case["causal"], scales=scales, what=what)


@pytest.mark.parametrize("step", ["first", "later"])
@pytest.mark.parametrize("case", UNMASKED, ids=cases.case_id)
def test_delayed_core_matches_reference_and_hands_back_the_next_history(case, step):
  q, k, v, dout, _ = cases.inputs(case, **SHAPE)
  history = jnp.zeros((3, 16), jnp.float32)
  if step == "later":
    history = history.at[:, 1].set(_amax(q, k, v) * 1.5)  # amaxes of two steps back
  (_, out), (dq, dk, dv, next_history) = _run(case, q, k, v, history, dout)
  _check(case, out, (dq, dk, dv), q, k, v, dout, _scales(history), f"delayed FP8 core, {step} step")
  np.testing.assert_array_equal(next_history, _fp8_delayed.roll(history, _amax(q, k, v)))


def test_an_amax_past_the_history_saturates_and_stays_finite():
  case = dict(heads="GQA", causal=True, masked=False, dtype=jnp.bfloat16)
  q, k, v, dout, _ = cases.inputs(case, **SHAPE)
  history = jnp.zeros((3, 4), jnp.float32).at[:, 0].set(_amax(q, k, v) / 16)  # q, k, v grew 16x since
  (_, out), grads = _run(case, q, k, v, history, dout)
  limits = 448.0 / _fp8_delayed.scales_from(history)  # (3,) the largest |value| each can hold
  assert all(float(jnp.max(jnp.abs(x))) > lim for x, lim in zip((q, k, v), limits))  # something did saturate
  clipped = [jnp.clip(x, -lim, lim).astype(x.dtype) for x, lim in zip((q, k, v), limits)]
  _check(case, out, grads[:3], *clipped, dout, _scales(history), "saturated delayed FP8 core")


def test_te_fp8_layer_training_step_advances_its_core_history():
  layer = MultiHeadAttention(4, 512, decode=False, backend="te-fp8", is_causal=True, dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 256, 512)).astype(jnp.bfloat16)
  graphdef, params, meta = nnx.split(layer, nnx.Param, FP8Meta)
  loss = lambda p, m: jnp.sum(nnx.merge(graphdef, p, m)(x).astype(jnp.float32) ** 2)
  plan = attnlayers.explain("te-fp8", *layer._fused_qkv(x), is_causal=True, fp8_amax_history=meta["fp8_core"][...])
  assert "from an amax history (delayed)" in str(plan), str(plan)
  _, new = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, meta)
  history = np.asarray(new["fp8_core"][...])
  assert history.shape == (3, 1024) and not history[:, 1:].any(), history[:, :4]
  np.testing.assert_allclose(history[:, 0], _amax(*layer._fused_qkv(x)), rtol=1e-2)  # the layer's q, k, v amaxes
