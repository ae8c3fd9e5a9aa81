"""models.softmax_onepass (interpreted): e * r equals the softmax and nll the float64 formula, on long and
ragged rows, padding, rows whose max lies far above their first block (the second sweep), and bad targets.
The GPU compiles the same kernel in tests/test_gpu_loss.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import softmax_onepass
from tests import reference

BLOCK = softmax_onepass.BLOCK


def _expected(x, t, real):
  """float64 softmax * real and -log softmax[target] * real."""
  x64 = x.astype(np.float64)
  p = np.exp(x64 - x64.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  with np.errstate(divide="ignore"):  # a target among -inf logits: p = 0, an infinite loss
    nll = -np.log(p[np.arange(len(t)), t]) * real
  return p * real[:, None], nll


def _run(x, t, real, dtype=jnp.float32):
  """(e * r, r, nll, e) as float32 numpy."""
  e, r, nll = softmax_onepass.softmax_scaled(jnp.asarray(x), jnp.asarray(t), jnp.asarray(real), dtype, interpret=True)
  e = np.asarray(e, np.float32)
  return e * np.asarray(r)[:, None], np.asarray(r), np.asarray(nll), e


@pytest.mark.parametrize("blocks", [1, 2.5], ids=["V=BLOCK", "V=2.5BLOCK"])
def test_scaled_gradient_on_long_rows_and_padding(blocks):
  """Logits spread by 30, ties, -inf entries, targets in the first and last block, and a padding row."""
  V = int(blocks * BLOCK)
  x = np.random.default_rng(1).normal(size=(5, V)).astype(np.float32) * 30
  x[1] = 2.0  # all tied
  x[2, 1::3] = -np.inf
  t, real = np.array([0, 5, V - 1, V - 3, 3]), np.array([1.0, 1.0, 1.0, 1.0, 0.0], np.float32)
  p, r, nll, _ = _run(x, t, real)
  p_ref, nll_ref = _expected(x, t, real)
  reference.assert_close(p, p_ref, jnp.float32, "grad", "e * r = softmax")
  reference.assert_close(nll, nll_ref, jnp.float32, "out", "-log p(target)")
  assert r[4] == 0.0 and np.all(r[:4] > 0)


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
  p, _, nll, e = _run(x, t, real)
  p_ref, nll_ref = _expected(x, t, real)
  assert np.isfinite(p).all() and np.isfinite(nll).all()
  reference.assert_close(p, p_ref, jnp.float32, "grad", f"e * r with a logit {above} above the first block")
  reference.assert_close(nll, nll_ref, jnp.float32, "out", "-log p(target)")
  swept_again = above - x[:2, :BLOCK].max() > softmax_onepass.LIMIT
  assert (e[:2].max() == 1.0) == swept_again and (e[:2].max() > 1e6) != swept_again  # which shift each row took
  assert e[2:].max() == 1.0  # shifted by their own max from the start


def test_many_large_logits_past_the_limit_keep_the_sum_finite():
  """A row of 2000 logits 82 above its first block: shifted by the first block's max, their sum of exp would
  overflow float32 (2000 * exp(82) = 8.2e38); the second sweep keeps it finite. A LIMIT of 82 or more fails."""
  V = 3 * BLOCK
  x = np.zeros((2, V), np.float32)
  x[0, BLOCK:BLOCK + 2000] = 82.0
  t, real = np.array([BLOCK + 3, 7]), np.ones(2, np.float32)
  p, r, nll, _ = _run(x, t, real)
  p_ref, nll_ref = _expected(x, t, real)
  assert np.isfinite(r).all() and r[0] > 0
  reference.assert_close(p, p_ref, jnp.float32, "grad", "e * r")
  reference.assert_close(nll, nll_ref, jnp.float32, "out", "-log p(target)")


def test_bfloat16_output_rounds_once():
  """bfloat16 out: e * r within bfloat16's tolerance of the float64 softmax, with logits past LIMIT."""
  x = np.random.default_rng(4).normal(size=(3, 2 * BLOCK + 5)).astype(np.float32) * 4
  x[1, -1] = 60.0
  t, real = np.array([7, 2 * BLOCK + 4, BLOCK]), np.ones(3, np.float32)
  p, _, nll, _ = _run(x, t, real, jnp.bfloat16)
  p_ref, nll_ref = _expected(x, t, real)
  reference.assert_close(p, p_ref, jnp.bfloat16, "grad", "e * r (bfloat16 e)")
  reference.assert_close(nll, nll_ref, jnp.float32, "out", "-log p(target)")


def test_bad_targets_and_a_padding_row_that_is_not_finite():
  """Under jit (targets unchecked): a target outside [0, V) gives a NaN loss; a padding row that is not finite
  still gives loss 0 and r = 0."""
  V = 37
  x = jnp.asarray(np.random.default_rng(2).normal(size=(4, V)), jnp.float32).at[3].set(jnp.nan)
  t, real = jnp.array([-1, V, 4, 0]), jnp.array([1.0, 1.0, 1.0, 0.0])
  _, r, nll = jax.jit(lambda x, t, r: softmax_onepass.softmax_scaled(x, t, r, jnp.float32, interpret=True))(
      x, t, real)
  assert np.isnan(nll[:2]).all() and np.isfinite(nll[2]) and nll[3] == 0.0 and r[3] == 0.0


def test_float16_and_shape_errors():
  x, t, real = jnp.zeros((2, 8)), jnp.zeros((2,), jnp.int32), jnp.ones((2,))
  with pytest.raises(ValueError, match=re.escape("out_dtype must be bfloat16 or float32")):
    softmax_onepass.softmax_scaled(x, t, real, jnp.float16, interpret=True)
  with pytest.raises(ValueError, match=re.escape("targets and real must be (C,) = (2,); got (3,), (2,)")):
    softmax_onepass.softmax_scaled(x, jnp.zeros((3,), jnp.int32), real, jnp.float32, interpret=True)
