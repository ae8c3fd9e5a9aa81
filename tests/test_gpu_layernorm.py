"""On an NVIDIA GPU: residual_norm on models.ops.norm_fwd's and models.ops.norm_grad's compiled Pallas kernels
against the float64 formula at the presets' widths, proof that they ran, and a float32 GPT's loss and gradients on
both kernels, with and without biases."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ops
from models.ops.layernorm import residual_norm
from tests import reference, test_layernorm
from tests.test_layernorm import DTYPES, _inputs, _ln, _oracle, _vjp

pytestmark = pytest.mark.gpu
TRITON = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"')


@pytest.mark.parametrize("d", [768, 1024, 2048], ids=lambda d: f"D{d}")  # gpt2-small, gpt2-medium, gpt-1b
@pytest.mark.parametrize("dtype", DTYPES)
def test_pallas_matches_float64(dtype, d):
  """B=4, T=1023: 4092 rows, a ragged last tile and more tiles than programs. dscale and dbias are sums over the
  rows, compared by reference.assert_close_sum (atol grown by sqrt(N)): float32 sums of 4092 terms carry more
  rounding than the float32 tolerance of one value (XLA's fusions miss it too). (Divided by N, as before, a
  bfloat16 dscale or dbias half its size passed.)"""
  ln, (x, dres, dy) = _ln(DTYPES[dtype], d), _inputs(DTYPES[dtype], d, 4, 1023)
  _, dx, dscale, dbias = jax.jit(lambda x, dr, dy: _vjp(lambda m, x: residual_norm(m, x, kernel="pallas"), ln, x, dr,
                                                        dy))(x, dres, dy)
  _, dx64, dscale64, dbias64 = _oracle(ln, x, dres, dy)
  reference.assert_close(dx, dx64, dtype, "grad", "dx")
  N = x.shape[0] * x.shape[1]
  reference.assert_close_sum(dscale, dscale64, dtype, N, "dscale")
  reference.assert_close_sum(dbias, dbias64, dtype, N, "dbias")


@pytest.mark.parametrize("d", [768, 1024, 2048], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_pallas_forward_with_a_branch_added(dtype, d):
  """s = x + a rounded to the dtype, exactly; ln(s) against float64; x and a get the same gradient."""
  ln, (x, dres, dy) = _ln(DTYPES[dtype], d), _inputs(DTYPES[dtype], d, 4, 1023)
  a = jax.random.normal(jax.random.key(5), x.shape).astype(x.dtype)
  def fn(x, a):
    out, vjp = jax.vjp(lambda x, a: residual_norm(ln, x, a, kernel="pallas"), x, a)
    return out, vjp((dres, dy))
  (s, y), (dx, da) = jax.jit(fn)(x, a)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(x + a, np.float32))
  y64, dx64, _, _ = _oracle(ln, x + a, dres, dy)
  reference.assert_close(y, y64, dtype, "out", "ln(x + a)")
  reference.assert_close(dx, dx64, dtype, "grad", "dx")
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(da, np.float32))


def test_auto_is_pallas_and_the_kernel_ran():
  ln, (x, dres, dy) = _ln(jnp.bfloat16, 768), _inputs(jnp.bfloat16, 768, 2, 64)
  if jax.device_count() > 1:
    pytest.skip(f"auto picks pallas on one GPU only; this process has {jax.device_count()} devices")
  assert ops.resolve("auto")[0] == "pallas"
  hlo = lambda kernel: jax.jit(lambda x: _vjp(lambda m, x: residual_norm(m, x, kernel=kernel), ln, x, dres, dy)).lower(
      x).compile().as_text()
  assert len(TRITON.findall(hlo("auto"))) == len(TRITON.findall(hlo("pallas"))) == 2  # forward, backward
  assert not TRITON.search(hlo("xla"))


@pytest.mark.parametrize("bias", [True, False])
def test_float32_model_on_both_kernels(bias):
  test_layernorm.test_model_loss_and_gradients_on_both_kernels(("xla", "pallas"), backend="xla", bias=bias)
