"""On an NVIDIA GPU: the training loss's Pallas softmax-gradient kernels (models.ops.softmax_onepass for bfloat16
and float32, models.ops.softmax_grad for float16) against the float64 oracle and XLA's fusions, at the test sizes
and at gpt2-small's vocabulary, and proof that they ran."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import ops
from models.ops import softmax_grad, softmax_onepass
from models.loss import head_cross_entropy
from tests import reference
from tests.test_loss import DTYPES, _inputs, _oracle

pytestmark = pytest.mark.gpu
TRITON = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"')


@pytest.mark.parametrize("chunk", [5, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("dtype", [*DTYPES, "float16"], ids=str)
def test_pallas_matches_oracle(dtype, chunk):
  """V = 5003 (several reads of the kernel and a ragged end), chunks with and without padding; float16 runs
  models.ops.softmax_grad, the others models.ops.softmax_onepass."""
  h, w, t = _inputs(DTYPES.get(dtype, jnp.float16), v=5003)
  N = t.size
  value_n, (dh, dw) = jax.jit(jax.value_and_grad(
      lambda h, w: N * head_cross_entropy(h, w, t, chunk=chunk, kernel="pallas"), (0, 1)))(h, w)
  ref, dh64, dw64 = _oracle(h, w, t)
  reference.assert_close(value_n / N, ref, h.dtype, "out", "loss")
  reference.assert_close(dh, N * dh64, h.dtype, "grad", "N * dh")
  reference.assert_close(dw, N * dw64, h.dtype, "grad", "N * dw")


def test_auto_is_pallas_and_the_kernel_ran():
  h, w, t = _inputs(jnp.bfloat16, v=5003)
  if jax.device_count() > 1:
    pytest.skip(f"auto picks pallas on one GPU only; this process has {jax.device_count()} devices")
  assert ops.resolve("auto")[0] == "pallas"
  hlo = lambda kernel: jax.jit(jax.grad(lambda h, w: head_cross_entropy(h, w, t, kernel=kernel), (0, 1))).lower(
      h, w).compile().as_text()
  assert TRITON.search(hlo("auto")) and TRITON.search(hlo("pallas"))
  assert not TRITON.search(hlo("xla"))


def test_gpt2_vocabulary_chunk_matches_xla():
  """One (512, 50304) bfloat16 chunk of logits spread like a trained model's: the kernel's softmax - onehot
  and loss against XLA's float32 formula, padding rows zero."""
  C, V = 512, 50304
  x = (jax.random.normal(jax.random.key(0), (C, V)) * 3).astype(jnp.bfloat16)
  t = jax.random.randint(jax.random.key(1), (C,), 0, V)
  real = (jnp.arange(C) < C - 3).astype(jnp.float32)
  g, nll = jax.jit(lambda x, t, r: softmax_grad.softmax_grad(x, t, r, jnp.bfloat16))(x, t, real)
  xf = x.astype(jnp.float32)
  ref_g = (jax.nn.softmax(xf) - jax.nn.one_hot(t, V)) * real[:, None]
  ref_nll = -jnp.take_along_axis(jax.nn.log_softmax(xf), t[:, None], -1)[:, 0] * real
  assert g.dtype == jnp.bfloat16 and not np.any(np.asarray(g[-3:], np.float32))
  reference.assert_close(g, ref_g, jnp.bfloat16, "grad", "softmax - onehot")
  reference.assert_close(nll, ref_nll, jnp.float32, "out", "-log p(target)")


def test_gpt2_vocabulary_chunk_float32_output():
  """The same chunk with a float32 gradient out, at float32's tolerance; each row of softmax - onehot sums to 0,
  which checks the many small entries together."""
  C, V = 512, 50304
  x = (jax.random.normal(jax.random.key(0), (C, V)) * 3).astype(jnp.bfloat16)
  t = jax.random.randint(jax.random.key(1), (C,), 0, V)
  real = jnp.ones((C,), jnp.float32)
  g, nll = jax.jit(lambda x, t, r: softmax_grad.softmax_grad(x, t, r, jnp.float32))(x, t, real)
  x64 = np.asarray(x, np.float64)
  p64 = np.exp(x64 - x64.max(-1, keepdims=True))
  p64 /= p64.sum(-1, keepdims=True)
  ref_g = p64.copy()
  ref_g[np.arange(C), np.asarray(t)] -= 1
  assert g.dtype == jnp.float32
  reference.assert_close(g, ref_g, jnp.float32, "grad", "softmax - onehot")
  reference.assert_close(g.sum(-1), np.zeros(C), jnp.float32, "grad", "row sums")
  reference.assert_close(nll, -np.log(p64[np.arange(C), np.asarray(t)]), jnp.float32, "out", "-log p(target)")


@pytest.mark.parametrize("out", ["bfloat16", "float32"])
def test_onepass_gpt2_vocabulary_chunk_matches_float64(out):
  """models.ops.softmax_onepass compiled, on a (512, 50304) bfloat16 chunk spread like a trained model's, with
  three rows whose max lies 50 above their first block (the second sweep: e <= 1 there; row 0's max is its
  target's logit, p(target) near 1) and three padding rows: e * r + onehot * a against softmax - onehot, a
  (p(target) - 1) relative to its own size, and the loss."""
  C, V = 512, 50304
  x = (jax.random.normal(jax.random.key(0), (C, V)) * 3).astype(jnp.bfloat16).at[:3, 30000].set(60.0)
  t = jax.random.randint(jax.random.key(1), (C,), 0, V).at[0].set(30000)
  real = (jnp.arange(C) < C - 3).astype(jnp.float32)
  e, r, a, nll = jax.jit(lambda x, t, r: softmax_onepass.softmax_scaled(x, t, r, jnp.dtype(out)))(x, t, real)
  x64 = np.asarray(x, np.float64)
  p64 = np.exp(x64 - x64.max(-1, keepdims=True))
  p64 /= p64.sum(-1, keepdims=True)
  rows, cols = np.arange(C), np.asarray(t)
  assert e.dtype == jnp.dtype(out) and np.all(np.asarray(r[-3:]) == 0) and np.all(np.asarray(a[-3:]) == 0)
  e32 = np.asarray(e, np.float32)
  assert np.all(e32[rows, cols] == 0) and e32[1:3].max() == 1.0  # rows 1, 2: swept again, their max not a target
  g = e32 * np.asarray(r)[:, None]
  g[rows, cols] += np.asarray(a)
  g64 = p64.copy()
  g64[rows, cols] -= 1
  real64 = np.asarray(real)[:, None]
  reference.assert_close(g, g64 * real64, jnp.dtype(out), "grad", "e * r + onehot * a = softmax - onehot")
  others = np.exp(x64 - x64.max(-1, keepdims=True))  # (C, V) the softmax's numerators
  whole = others.sum(-1)
  others[rows, cols] = 0
  want = -others.sum(-1) / whole  # p(target) - 1 without cancelling: row 0's is -3.7e-20
  np.testing.assert_allclose(np.asarray(a)[:-3], want[:-3], rtol=1e-4, err_msg="a = p(target) - 1")
  reference.assert_close(nll, -np.log(p64[np.arange(C), np.asarray(t)]) * np.asarray(real), jnp.float32, "out",
                         "-log p(target)")
