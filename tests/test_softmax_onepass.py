"""models.ops.softmax_onepass (interpreted): e * r + onehot * a equals softmax - onehot and nll the float64 formula,
on long and ragged rows, padding, rows whose max lies far above their first block (the second sweep), confident
rows (p(target) near 1, where a must keep its relative precision), and bad targets. The GPU compiles the same
kernel in tests/test_gpu_loss.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.ops import softmax_onepass
from tests import reference

BLOCK = softmax_onepass.BLOCK


def _softmax64(x):
  x64 = x.astype(np.float64)
  p = np.exp(x64 - x64.max(1, keepdims=True))
  return p / p.sum(1, keepdims=True)


def _expected(x, t, real):
  """float64 (softmax - onehot) * real and -log softmax[target] * real."""
  p = _softmax64(x)
  with np.errstate(divide="ignore"):  # a target among -inf logits: p = 0, an infinite loss
    nll = -np.log(p[np.arange(len(t)), t]) * real
  p[np.arange(len(t)), t] -= 1
  return p * real[:, None], nll


def _run(x, t, real, dtype=jnp.float32):
  """(e * r + onehot * a, r, nll, e, a) as float32 numpy."""
  e, r, a, nll = softmax_onepass.softmax_scaled(jnp.asarray(x), jnp.asarray(t), jnp.asarray(real), dtype,
                                                interpret=True)
  e, r, a = np.asarray(e, np.float32), np.asarray(r), np.asarray(a)
  assert np.all(e[np.arange(len(t)), t] == 0), "e must hold 0 at each row's target"
  g = e * r[:, None]
  g[np.arange(len(t)), t] += a
  return g, r, np.asarray(nll), e, a


@pytest.mark.parametrize("blocks", [1, 2.5], ids=["V=BLOCK", "V=2.5BLOCK"])
def test_scaled_gradient_on_long_rows_and_padding(blocks):
  """Logits spread by 30, ties, -inf entries, targets in the first and last block, and a padding row."""
  V = int(blocks * BLOCK)
  x = np.random.default_rng(1).normal(size=(5, V)).astype(np.float32) * 30
  x[1] = 2.0  # all tied
  x[2, 1::3] = -np.inf
  t, real = np.array([0, 5, V - 1, V - 3, 3]), np.array([1.0, 1.0, 1.0, 1.0, 0.0], np.float32)
  g, r, nll, _, a = _run(x, t, real)
  g_ref, nll_ref = _expected(x, t, real)
  reference.assert_close(g, g_ref, jnp.float32, "grad", "e * r + onehot * a = softmax - onehot")
  reference.assert_close(nll, nll_ref, jnp.float32, "out", "-log p(target)")
  assert r[4] == a[4] == 0.0 and np.all(r[:4] > 0)


@pytest.mark.parametrize("above", [30.0, 50.0, 500.0], ids=["within-limit", "past-limit", "past-float32-exp"])
def test_a_max_far_above_the_first_block(above):
  """The shift is the first block's max: a later logit up to LIMIT above it is taken as is (e up to exp(30));
  past LIMIT (and past exp's float32 range) the row is swept again, shifted by its max, so that e <= 1. Rows 0
  and 1 hold the large logit after their first block; row 2 (none) and row 3 (in its first block) do not."""
  rng = np.random.default_rng(3)
  V = 3 * BLOCK
  x = rng.normal(size=(4, V)).astype(np.float32)
  x[0, 2 * BLOCK + 7] = above  # the target's logit
  x[1, BLOCK + 1] = above  # not the target's
  x[3, 5] = above
  t, real = np.array([2 * BLOCK + 7, 4, 9, 5]), np.ones(4, np.float32)
  g, _, nll, e, _ = _run(x, t, real)
  g_ref, nll_ref = _expected(x, t, real)
  assert np.isfinite(g).all() and np.isfinite(nll).all()
  reference.assert_close(g, g_ref, jnp.float32, "grad", f"e * r + onehot * a, a logit {above} above the first block")
  reference.assert_close(nll, nll_ref, jnp.float32, "out", "-log p(target)")
  swept_again = above - x[1, :BLOCK].max() > softmax_onepass.LIMIT  # row 1: the large logit is not its target's
  assert (e[1].max() == 1.0) == swept_again and (e[1].max() > 1e6) != swept_again  # which shift the row took
  assert e[0].max() <= (1.0 if swept_again else np.exp(above)) and e[2].max() == 1.0  # row 0: its target holds 0


def test_many_large_logits_past_the_limit_keep_the_sum_finite():
  """A row of 2000 logits 82 above its first block: shifted by the first block's max, their sum of exp would
  overflow float32 (2000 * exp(82) = 8.2e38); the second sweep keeps it finite. A LIMIT of 82 or more fails."""
  V = 3 * BLOCK
  x = np.zeros((2, V), np.float32)
  x[0, BLOCK:BLOCK + 2000] = 82.0
  t, real = np.array([BLOCK + 3, 7]), np.ones(2, np.float32)
  g, r, nll, _, _ = _run(x, t, real)
  g_ref, nll_ref = _expected(x, t, real)
  assert np.isfinite(r).all() and r[0] > 0
  reference.assert_close(g, g_ref, jnp.float32, "grad", "e * r + onehot * a")
  reference.assert_close(nll, nll_ref, jnp.float32, "out", "-log p(target)")


def test_bfloat16_output_rounds_once():
  """bfloat16 out: e * r + onehot * a within bfloat16's tolerance of the float64 softmax - onehot, with logits past
  LIMIT."""
  x = np.random.default_rng(4).normal(size=(3, 2 * BLOCK + 5)).astype(np.float32) * 4
  x[1, -1] = 60.0
  t, real = np.array([7, 2 * BLOCK + 4, BLOCK]), np.ones(3, np.float32)
  g, _, nll, _, _ = _run(x, t, real, jnp.bfloat16)
  g_ref, nll_ref = _expected(x, t, real)
  reference.assert_close(g, g_ref, jnp.bfloat16, "grad", "e * r + onehot * a (bfloat16 e)")
  reference.assert_close(nll, nll_ref, jnp.float32, "out", "-log p(target)")


def test_bad_targets_and_a_padding_row_that_is_not_finite():
  """Under jit (targets unchecked): a target outside [0, V) gives a NaN loss; a padding row that is not finite
  still gives loss 0 and r = 0."""
  V = 37
  x = jnp.asarray(np.random.default_rng(2).normal(size=(4, V)), jnp.float32).at[3].set(jnp.nan)
  t, real = jnp.array([-1, V, 4, 0]), jnp.array([1.0, 1.0, 1.0, 0.0])
  _, r, a, nll = jax.jit(lambda x, t, r: softmax_onepass.softmax_scaled(x, t, r, jnp.float32, interpret=True))(
      x, t, real)
  assert np.isnan(nll[:2]).all() and np.isfinite(nll[2]) and nll[3] == 0.0 and r[3] == a[3] == 0.0


@pytest.mark.parametrize("out", ["bfloat16", "float32"])
def test_a_confident_row_keeps_p_minus_1_to_float32_precision(out):
  """1 - p(target) from about 6e-6 down to 8e-10, the target in the first block (the shift is its logit) or after
  it, and about 1e-20 with the target past LIMIT (the second sweep): a = p - 1 within 1e-5 of float64, relative to
  its own small size, whatever e is rounded to. (e_target * r - 1
  from a rounded e_target is off by up to 2^-9 absolute in bfloat16, 6e-8 in float32; (e_target - s) / s by s's
  rounding, about 6e-8: both far more than 1 - p here.)"""
  V = 3 * BLOCK
  rng = np.random.default_rng(6)
  x = rng.normal(size=(10, V)).astype(np.float32)
  t = np.array([3, 2 * BLOCK + 5] * 5)
  margins = np.repeat([12.0, 14.0, 17.0, 21.0, 45.0], 2)  # above the other logits' log-sum-exp, about log V + 0.5
  x[np.arange(10), t] = margins + np.log(np.exp(x.astype(np.float64)).sum(1)).astype(np.float32)
  _, _, _, e, a = _run(x, t, np.ones(10, np.float32), jnp.dtype(out))
  numerators = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))  # (10, V)
  whole = numerators.sum(1)
  numerators[np.arange(10), t] = 0
  want = -numerators.sum(1) / whole  # (10,) p(target) - 1 without cancelling: about -6e-6 down to -2e-20
  assert np.all(want[:8] > -1e-5) and np.all(want[:8] < -1e-10) and np.all(want[8:] > -1e-18), want
  assert e[9].max() < 1e-15  # row 9: its target lies past LIMIT above its first block, so it was swept again
  np.testing.assert_allclose(a, want, rtol=1e-5)


def test_float16_and_shape_errors():
  x, t, real = jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32), jnp.ones((2,))
  with pytest.raises(ValueError, match=re.escape("out_dtype must be bfloat16 or float32")):
    softmax_onepass.softmax_scaled(x, t, real, jnp.float16, interpret=True)
  with pytest.raises(ValueError, match=re.escape("targets and real must be (C,) = (2,); got (3,), (2,)")):
    softmax_onepass.softmax_scaled(x, jnp.zeros((3,), jnp.int32), real, jnp.float32, interpret=True)
