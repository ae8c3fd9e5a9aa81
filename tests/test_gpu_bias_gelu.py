"""On an NVIDIA GPU: models.ops.bias_gelu's compiled Pallas kernels against the float64 formula at the presets' MLP
widths, and proof that they ran."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ops
from models.ops import bias_gelu
from tests import reference
from tests.test_bias_gelu import DTYPES, _inputs, _oracle, _with_vjp
from tests.test_gpu_layernorm import TRITON
from train.step import STEP_COMPILER_OPTIONS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("f", [3072, 4096, 8192], ids=lambda f: f"F{f}")  # gpt2-small, gpt2-medium, gpt-1b
@pytest.mark.parametrize("dtype", DTYPES)
def test_pallas_matches_float64(dtype, f):
  """B=4, T=1023: 4092 rows, a ragged last row tile and more row tiles than backward programs."""
  z, b, dy = _inputs(DTYPES[dtype], (4, 1023, f))
  y, dz, db = jax.jit(lambda z, b, dy: _with_vjp(z, b, dy, "pallas"))(z, b, dy)
  y64, dz64, db64 = _oracle(z, b, dy)
  reference.assert_close(y, y64, dtype, "out", "gelu(z + b)")
  reference.assert_close(dz, dz64, dtype, "grad", "dz")
  reference.assert_close_sum(db, db64, dtype, z.shape[0] * z.shape[1], "db")


def test_auto_is_pallas_and_the_kernels_ran():
  if jax.device_count() > 1:
    pytest.skip(f"auto picks pallas on one GPU only; this process has {jax.device_count()} devices")
  z, b, dy = _inputs(jnp.bfloat16, (2, 64, 3072))
  assert ops.resolve("auto")[0] == "pallas"
  hlo = lambda kernel: jax.jit(lambda z, b, dy: _with_vjp(z, b, dy, kernel)).lower(z, b, dy).compile().as_text()
  assert len(TRITON.findall(hlo("auto"))) == 2 and len(TRITON.findall(hlo("pallas"))) == 2
  assert not TRITON.search(hlo("xla"))


def test_gelu_of_gemm_after_a_gemm_matches_float64():
  """gelu(h @ w) and d/dh with the GELU in the GEMM's epilogue (gpt2-small's widths, B=4, T=1024, bfloat16: a
  float32 GEMM runs in TF32 by default), against float64 from the same inputs; the epilogue ran (GELU_AUX) and the
  backward is the Pallas kernel."""
  dtype = "bfloat16"
  kh, kw, ky = jax.random.split(jax.random.key(1), 3)
  h = jax.random.normal(kh, (4, 1024, 768)).astype(DTYPES[dtype])  # (B, T, D); 4092 rows: XLA pads the GEMM, no epilogue
  w = (jax.random.normal(kw, (768, 3072)) / 768 ** 0.5 * 3).astype(DTYPES[dtype])  # (D, F): z about 3 N(0, 1)
  dy = jax.random.normal(ky, (4, 1024, 3072)).astype(DTYPES[dtype])  # (B, T, F)

  def run(h, w, dy):
    y, vjp = jax.vjp(lambda h: bias_gelu.gelu_of_gemm(h @ w, kernel="pallas"), h)
    return y, *vjp(dy)
  fn = jax.jit(run, compiler_options=STEP_COMPILER_OPTIONS)
  hlo = fn.lower(h, w, dy).compile().as_text()
  assert hlo.count('"epilogue":"GELU_AUX"') == 1 and len(TRITON.findall(hlo)) == 1, hlo
  y, dh = fn(h, w, dy)
  z64 = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  y64, g64, _ = _oracle(z64, np.zeros(3072), dy)
  reference.assert_close(y, y64, dtype, "out", "gelu(h @ w)")
  dh64 = g64 @ np.asarray(w, np.float64).T
  reference.assert_close(np.asarray(dh, np.float64) / 768 ** 0.5, dh64 / 768 ** 0.5, dtype, "grad", "dh / sqrt(F/4)")
