"""te-fp8's delayed-scaling FP8 core (attnlayers.backends._fp8_delayed) on CPU: its scales, saturation,
the history its gradient hands back, and the argument checks. The cuDNN kernels need a GPU, so here
they are replaced by a float32 attention on the dequantised tensors (what the FP8 kernel computes up
to P's rounding); tests/test_gpu_fp8_delayed.py runs the real ones."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnlayers
from attnlayers.backends import _fp8_core, _fp8_delayed
from attnlayers.fp8 import FP8Meta, FP8Recipe
from attnlayers.nnx import MultiHeadAttention
from tests import reference

B, T, N, K, H = 2, 32, 4, 2, 16


def _f32_attention(q, k, v, *, scale, is_causal):
  return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, implementation="xla")


def _dequantize(x8s, scales):
  return [x8.astype(jnp.float32) / s for x8, s in zip(x8s, scales)]


def _fake_forward(q8, k8, v8, scales, dtype, *, scale, is_causal):
  out = _f32_attention(*_dequantize((q8, k8, v8), scales), scale=scale, is_causal=is_causal)
  return out.astype(dtype), jnp.zeros(())


def _fake_backward(q8, k8, v8, scales, out, stats, dout, *, scale, is_causal):
  f = lambda q, k, v: _f32_attention(q, k, v, scale=scale, is_causal=is_causal)
  _, pullback = jax.vjp(f, *_dequantize((q8, k8, v8), scales))
  return tuple(g.astype(out.dtype) for g in pullback(dout.astype(jnp.float32)))


@pytest.fixture
def cpu_kernels(monkeypatch):
  monkeypatch.setattr(_fp8_delayed, "quantized_forward", _fake_forward)
  monkeypatch.setattr(_fp8_delayed, "quantized_backward", _fake_backward)
  monkeypatch.setattr(_fp8_core, "quantized_forward", _fake_forward)
  monkeypatch.setattr(_fp8_core, "quantized_backward", _fake_backward)


def _inputs(seed=0):
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (B, T, N, H)).astype(jnp.bfloat16)  # (B, T, N, H)
  k, v = (3 * jax.random.normal(key, (B, T, K, H)).astype(jnp.bfloat16) for key in (kk, kv))  # (B, T, K, H)
  return q, k, v, jax.random.normal(kd, (B, T, N, H))


def _amax(*xs):
  return jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in xs])  # (3,)


def _run(q, k, v, history, dout):
  def loss(q, k, v, h):
    out = _fp8_delayed.attention(q, k, v, h, H**-0.5, True)
    return jnp.sum(out.astype(jnp.float32) * dout), out
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, history)


def _reference(q, k, v, dout):
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  options = dict(is_causal=True, scale=H**-0.5)
  out, _ = reference.forward(f64(q), f64(k), f64(v), **options)
  return out, reference.gradients(f64(q), f64(k), f64(v), np.asarray(dout), **options)


def _check_dequantised(q, k, v, scales, dout, out, grads, what):
  """With the fake kernels the core is float32 attention on q, k, v as E4M3 holds them (x * s rounded, saturated
  at 448, then / s): against the float64 reference of exactly those tensors, to bf16's tolerance (out and grads are
  bf16). The FP8 rule above (1/8 of the largest value) also passes a dk 10% too small or a wrong scale."""
  f64 = lambda x: np.asarray(x, np.float64)
  deq = [f64(jnp.clip(x.astype(jnp.float32) * s, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32) / s)
         for x, s in zip((q, k, v), np.asarray(scales))]
  options = dict(is_causal=True, scale=H**-0.5)
  want, _ = reference.forward(*deq, **options)
  reference.assert_close(out, want, jnp.bfloat16, "out", f"{what} vs dequantised inputs")
  for name, got, ref in zip("qkv", grads, reference.gradients(*deq, np.asarray(dout), **options)):
    reference.assert_close(got, ref, jnp.bfloat16, "grad", f"{what} d{name} vs dequantised inputs")


def test_scales_are_powers_of_two_from_each_rows_max():
  history = jnp.array([[3.0, 1.0, 0.0], [0.0, 0.0, 448.0], [0.0, 0.0, 0.0]])
  np.testing.assert_array_equal(_fp8_delayed.scales_from(history), [128.0, 1.0, 1.0])  # 448/3 -> 128; empty row -> 1
  np.testing.assert_array_equal(_fp8_delayed.scales_from(jnp.full((3, 2), 449.0)), [0.5] * 3)


def test_quantize_saturates_instead_of_overflowing_and_reports_the_true_amax():
  x = jnp.array([1000.0, -1000.0, 0.5, 0.0], jnp.bfloat16)
  x8, amax = _fp8_delayed.quantize(x, jnp.float32(1.0))
  np.testing.assert_array_equal(np.asarray(x8.astype(jnp.float32)), [448.0, -448.0, 0.5, 0.0])
  assert float(amax) == 1000.0


def test_roll_puts_the_latest_amax_first():
  history = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
  got = _fp8_delayed.roll(history, jnp.array([-1.0, -2.0, -3.0]))
  np.testing.assert_array_equal(got, [[-1, 0, 1, 2], [-2, 4, 5, 6], [-3, 8, 9, 10]])


def test_a_non_finite_amax_enters_the_history_as_nothing_measured():
  history = jnp.full((3, 2), 4.0, jnp.float32)
  got = _fp8_delayed.roll(history, jnp.array([jnp.inf, jnp.nan, 2.0]))
  np.testing.assert_array_equal(got, [[0, 4], [0, 4], [2, 4]])
  np.testing.assert_array_equal(_fp8_delayed.scales_from(got), _fp8_delayed.scales_from(history))


@pytest.mark.parametrize("step", ["first", "later"])
def test_delayed_core_matches_reference_and_its_gradient_is_the_next_history(cpu_kernels, step):
  q, k, v, dout = _inputs()
  history = jnp.zeros((3, 8), jnp.float32)
  if step == "later":
    history = history.at[:, 0].set(_amax(q, k, v) * 1.5)  # an earlier step's amaxes
  (_, out), (dq, dk, dv, next_history) = _run(q, k, v, history, dout)
  want, want_grads = _reference(q, k, v, dout)
  reference.assert_close(out, want, "fp8", "out", f"delayed core, {step} step")
  for name, got, ref in zip("qkv", (dq, dk, dv), want_grads):
    reference.assert_close(got, ref, "fp8", "grad", f"delayed core d{name}, {step} step")
  _check_dequantised(q, k, v, _fp8_delayed.scales_from(history), dout, out, (dq, dk, dv), f"delayed core, {step} step")
  np.testing.assert_array_equal(next_history, _fp8_delayed.roll(history, _amax(q, k, v)))


def test_current_scaling_core_matches_reference(cpu_kernels):
  """te-fp8's current-scaling core (_fp8_core.attention: each scale from this call's max|x|), its quantisation and
  custom_vjp on the fake kernels: the float64 reference (FP8 rule) and the dequantised tensors' (bf16 rule)."""
  q, k, v, dout = _inputs()
  def loss(q, k, v):
    out = _fp8_core.attention(q, k, v, H**-0.5, True)
    return jnp.sum(out.astype(jnp.float32) * dout), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  assert out.dtype == q.dtype and all(g.dtype == q.dtype for g in grads)
  want, want_grads = _reference(q, k, v, dout)
  reference.assert_close(out, want, "fp8", "out", "current-scaling core")
  for name, got, ref in zip("qkv", grads, want_grads):
    reference.assert_close(got, ref, "fp8", "grad", f"current-scaling core d{name}")
  scales = _fp8_core.pow2_scale(_amax(q, k, v))
  assert float(jnp.min(scales * _amax(q, k, v))) > 224  # the largest power of two that fits: E4M3's upper half
  _check_dequantised(q, k, v, scales, dout, out, grads, "current-scaling core")


# Two CPU devices in a process of their own, the batch split over a "data" axis as train.loop.data_mesh splits it;
# row 1 (device 1's) of q, k and v is 64x larger, so a per-device amax would differ between the devices.
_DATA_PARALLEL = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from attnlayers.backends import _fp8_delayed
    from tests import test_fp8_delayed as t
    from train.loop import data_mesh
    _fp8_delayed.quantized_forward, _fp8_delayed.quantized_backward = t._fake_forward, t._fake_backward
    assert jax.device_count() == 2, jax.devices()
    q, k, v, dout = t._inputs()
    q, k, v = (x.at[1].multiply(64) for x in (q, k, v))  # (B=2, ...): row 1 lies on device 1
    history = jnp.zeros((3, 8), jnp.float32).at[:, 0].set(t._amax(q, k, v))
    mesh = data_mesh(jax.devices())
    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    run = jax.jit(t._run)
    (_, out), grads = run(*(jax.device_put(x, rows) for x in (q, k, v)), jax.device_put(history, whole),
                          jax.device_put(dout, rows))
    (_, out1), grads1 = run(*(jax.device_put(x, jax.devices()[0]) for x in (q, k, v, history, dout)))
    copies = [np.asarray(s.data) for s in grads[3].addressable_shards]
    assert len(copies) == 2 and all(c.shape == (3, 8) for c in copies), [c.shape for c in copies]
    want = np.asarray(_fp8_delayed.roll(history, t._amax(q, k, v)))  # the whole batch's amaxes
    for c in copies:
      np.testing.assert_array_equal(c, want)
    np.testing.assert_array_equal(np.asarray(grads[3]), np.asarray(grads1[3]))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out1))
    for g, g1 in zip(grads[:3], grads1[:3]):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g1, np.float32), rtol=1e-6, atol=1e-6)
    print("global amax history on both devices")
""")


@pytest.mark.slow
def test_data_parallel_history_holds_the_whole_batchs_amax_on_every_device():
  """jit's global semantics: the amax is reduced over the data axis, so each device's copy of the next history
  is the one a single device computes (the data-parallel half of te-fp8's core; TE's GEMMs need GPUs)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  done = subprocess.run([sys.executable, "-c", _DATA_PARALLEL], cwd=root, env=env, text=True, capture_output=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "global amax history on both devices" in done.stdout


def test_an_amax_past_the_history_saturates_and_stays_finite(cpu_kernels):
  q, k, v, dout = _inputs()
  history = jnp.zeros((3, 4), jnp.float32).at[:, 0].set(_amax(q, k, v) / 16)  # q, k, v grew 16x since
  (_, out), grads = _run(q, k, v, history, dout)
  limits = 448.0 / _fp8_delayed.scales_from(history)  # (3,) the largest |value| each can hold
  clipped = [jnp.clip(x.astype(jnp.float32), -lim, lim) for x, lim in zip((q, k, v), limits)]
  assert all(float(jnp.max(jnp.abs(x))) > lim for x, lim in zip((q, k, v), limits))  # something did saturate
  want, want_grads = _reference(*clipped, dout)
  reference.assert_close(out, want, "fp8", "out", "saturated delayed core")
  for name, got, ref in zip("qkv", grads[:3], want_grads):
    reference.assert_close(got, ref, "fp8", "grad", f"saturated delayed core d{name}")
  _check_dequantised(q, k, v, _fp8_delayed.scales_from(history), dout, out, grads[:3], "saturated delayed core")


def test_amax_history_argument_is_checked():
  q, k, v, _ = _inputs()
  history = jnp.zeros((3, 4), jnp.float32)
  with pytest.raises(ValueError, match="backend='cudnn' takes none"):
    attnlayers.explain("cudnn", q, k, v, fp8_amax_history=history)
  with pytest.raises(ValueError, match=r"float32 array \(3, L\)"):
    attnlayers.explain("te-fp8", q, k, v, fp8_amax_history=jnp.zeros((4,), jnp.float32))
  with pytest.raises(ValueError, match=r"float32 array \(3, L\)"):
    attnlayers.explain("te-fp8", q, k, v, fp8_amax_history=history.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="fp8_core='bf16' runs the bf16 core"):
    attnlayers.explain("te-fp8", q, k, v, fp8_core="bf16", fp8_amax_history=history)


@pytest.mark.parametrize("recipe, has_history", [(FP8Recipe(), True), (FP8Recipe(amax_history_len=16), True),
                                                 (FP8Recipe(kind="current"), False), (FP8Recipe(core="bf16"), False)],
                         ids=["delayed", "delayed-16", "current", "bf16-core"])
def test_te_fp8_layer_keeps_a_core_history_with_delayed_scaling_only(recipe, has_history):
  make = lambda backend, **kw: MultiHeadAttention(4, 64, decode=False, backend=backend, rngs=nnx.Rngs(0), **kw)
  layer = make("te-fp8", fp8_recipe=recipe)
  if has_history:
    assert isinstance(layer.fp8_core, FP8Meta) and layer.fp8_core.shape == (3, recipe.amax_history_len)
    assert not np.asarray(layer.fp8_core[...]).any()
  else:
    assert layer.fp8_core is None
  same = jax.tree.structure(nnx.state(layer, nnx.Param)) == jax.tree.structure(nnx.state(make("cudnn"), nnx.Param))
  assert same, "the FP8 state must not change the parameter tree"
