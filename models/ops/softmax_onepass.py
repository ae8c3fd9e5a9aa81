"""One chunk's cross-entropy gradient with one read of the logits: the softmax up to a row scale.

Letters: C tokens in the chunk, V vocabulary, D model width.

Why: models.ops.softmax_grad reads each row of logits twice, once for its max and sum(exp) and once
to write softmax - onehot, since the softmax is not known before the sum is. But what follows it
is two GEMMs (models.loss: dh = g @ w, dw = g^T @ h), and a row scale passes through both: with
e = exp(x - c) for any shift c, 0 at the target, s = sum(exp(x - c)) over the whole row, r = 1 / s
and a = p(target) - 1 = -(s - exp(x_target - c)) / s,

    (softmax - onehot) @ w   = r * (e @ w) + a * w[target]                    ((C, D) work after)
    (softmax - onehot)^T @ h = e^T @ (h * r) + onehot^T @ (a * h)             ((C, D) work before and after)

So this kernel writes e in the sweep that computes s and returns r and a; models.loss scales the
(C, D) rows and applies the target's term in float32 (a gather of w's target rows, a scatter-add
of h's rows into dw), small next to the (C, V) block. It reads the logits once instead of twice.

The shift c is the max of a row's first BLOCK logits (the max of the whole row is not known
before the sweep). Logits more than LIMIT above it would make e overflow; then the row is swept
again with c its max (every sweep tracks it), as models.ops.softmax_grad shifts. The output dtype
must have float32's exponent range (bfloat16, float32): e can reach exp(LIMIT) and h / s can be
as small as 1 / (V exp(LIMIT)); float16 takes models.ops.softmax_grad.

Numerics: each e is float32, rounded once to the output dtype, as models.ops.softmax_grad rounds
softmax - onehot. The target's entry is never rounded: a is minus a float32 ratio of two float32
sums, the other entries' and the whole row's, so p(target) - 1 keeps its relative precision however
close p(target) comes to 1 (a confident prediction). Taking it as e_target * r - 1 after the GEMMs
instead, with e_target rounded to bfloat16, loses it there (tests/test_loss.py checks a confident
prediction); rounding e - s at the target as a whole loses precision at a flat softmax instead.
models.loss also rounds h / s to the compute dtype for dw's GEMM. A padding row (real 0) gets
r = a = 0 and its row of e is left as computed (its logits are finite: padding h is 0), so that
the scalings zero it. nll is -log softmax(x)[target] = log s - (x_target - c), float32.

models.ops.resolve says where it can run (a CUDA GPU); `interpret=True` runs the same kernel on any
backend (slowly), which is how the CPU tests check it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from models.ops import tiling
from models.ops.tiling import plgpu

BLOCK = 1024  # logits per row read at a time (a power of two, as Triton's blocks must be)
WARPS = 4  # Triton warps per program; BLOCK and WARPS are the fastest tried on an H200 at GPT-2's vocabulary
LIMIT = 40.0  # the most the row's max may exceed the shift c: e <= exp(40) = 2.4e17, s <= V exp(40)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))  # output dtypes with float32's exponent range


def softmax_scaled(logits: Float[Array, "C V"], targets: Int[Array, "C"], real: Float[Array, "C"], out_dtype, *,
                   interpret: bool = False
                   ) -> tuple[Float[Array, "C V"], Float[Array, "C"], Float[Array, "C"], Float[Array, "C"]]:
  """(e, r, a, nll): e * r[:, None] + onehot(targets) * a[:, None] = (softmax(logits) - onehot) * real, with e in
  out_dtype (bfloat16 or float32, 0 at each row's target), r and a float32 (0 for padding; a = p(target) - 1), and
  -log softmax(logits)[target] (float32; 0 for padding). real is 1 for a token and 0 for padding. A token whose
  target lies outside [0, V) (unchecked under jit) gets a NaN loss."""
  if jnp.dtype(out_dtype) not in DTYPES:
    raise ValueError(f"out_dtype must be bfloat16 or float32 (float32's exponent range: e reaches exp({LIMIT})); "
                     f"got {jnp.dtype(out_dtype)}. float16 takes models.ops.softmax_grad")
  kernel = functools.partial(_kernel, blocks=-(-logits.shape[1] // BLOCK))
  return tiling.row_call(kernel, logits, targets, real, out_dtype, 3, warps=WARPS, interpret=interpret)


def _kernel(x_ref, t_ref, real_ref, e_ref, r_ref, a_ref, nll_ref, *, blocks: int):
  """One row: x_ref (V,) logits, t_ref (1,) target, real_ref (1,); e_ref (V,), r_ref, a_ref, nll_ref (1,).

  Each of the BLOCK lanes keeps its own max, sum of e (the target's entry left out) and target logit over the
  logits it sees (lane i: logits i, BLOCK + i, ...), combined once after the sweep."""
  t, real = t_ref[...], real_ref[...]  # (1,), (1,)
  lane = jnp.arange(BLOCK)  # (BLOCK,)
  load = lambda j: tiling.row_block(x_ref, j, lane)  # (BLOCK,) float32 logits (-inf past V), indices, mask

  def sweep(j, carry):  # writes e = exp(x - c), 0 at the target; per lane: max, sum of e, the target's logit
    c, m, s, target = carry
    x, idx, valid = load(j)
    hit = idx == t
    e = jnp.where(hit, 0.0, jnp.exp(x - c))  # 0 past V
    plgpu.store(e_ref.at[pl.ds(j * BLOCK, BLOCK)], e.astype(e_ref.dtype), mask=valid)
    return c, jnp.maximum(m, x), s + e, target + jnp.where(hit, x, 0.0)

  zeros = jnp.zeros((BLOCK,), jnp.float32)
  c0 = jnp.max(load(0)[0])  # the shift: the first block's max
  _, m_lane, s_lane, t_lane = jax.lax.fori_loop(0, blocks, sweep, (c0, jnp.full((BLOCK,), -jnp.inf), zeros, zeros))
  m, rest, x_t = jnp.max(m_lane), jnp.sum(s_lane), jnp.sum(t_lane)  # rest: sum of e but the target's

  def again(_):  # the max lies more than LIMIT above c0: the row once more, shifted by its max
    return m, jnp.sum(jax.lax.fori_loop(0, blocks, sweep, (m, m_lane, zeros, zeros))[2])

  c, rest = jax.lax.cond(m - c0 > LIMIT, again, lambda _: (c0, rest), None)
  s = rest + jnp.exp(x_t - c)  # the whole row's sum of exp(x - c)
  r_ref[...] = jnp.where(real > 0, 1 / s, 0.0)  # (1,) padding: 0 even where its row is not finite
  a_ref[...] = jnp.where(real > 0, -rest / s, 0.0)  # (1,) p(target) - 1, no cancellation
  nll_ref[...] = (jnp.log(s) - (x_t - c)) * real  # (1,)
