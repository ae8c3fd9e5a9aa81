"""On an NVIDIA GPU: models.bias_gelu's compiled Pallas kernels against the float64 formula at the presets' MLP
widths, and proof that they ran."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import kernels
from tests import reference
from tests.test_bias_gelu import DTYPES, _inputs, _oracle, _with_vjp
from tests.test_gpu_layernorm import TRITON

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
  N = z.shape[0] * z.shape[1]
  reference.assert_close(np.asarray(db, np.float64) / N, db64 / N, dtype, "grad", "db / N")


def test_auto_is_pallas_and_the_kernels_ran():
  if jax.device_count() > 1:
    pytest.skip(f"auto picks pallas on one GPU only; this process has {jax.device_count()} devices")
  z, b, dy = _inputs(jnp.bfloat16, (2, 64, 3072))
  assert kernels.resolve("auto")[0] == "pallas"
  hlo = lambda kernel: jax.jit(lambda z, b, dy: _with_vjp(z, b, dy, kernel)).lower(z, b, dy).compile().as_text()
  assert len(TRITON.findall(hlo("auto"))) == 2 and len(TRITON.findall(hlo("pallas"))) == 2
  assert not TRITON.search(hlo("xla"))
