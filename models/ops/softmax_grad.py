"""One chunk's cross-entropy and its logits gradient in one GPU kernel (Pallas, Triton).

Letters: C tokens in the chunk, V vocabulary.

Why: models.loss computes, for each (C, V) block of logits, every row's max and sum(exp)
and then softmax - onehot. As XLA fusions that is a variadic reduction and an elementwise
pass, each reading the logits. This kernel gives each row one program: an online max / sum(exp)
over the row, then a second sweep that writes softmax - onehot and collects the target's logit.
Same float32 arithmetic as models.loss's XLA path; only the order of the row sums differs. The
second sweep reads the row from HBM again (a row per program and thousands of programs in flight
do not fit in L2); holding the whole row in registers instead spills. models.ops.softmax_onepass
reads the logits once, and takes every output dtype but float16, which takes this kernel.

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

BLOCK = 2048  # logits per row read at a time (a power of two, as Triton's blocks must be)
WARPS = 4  # Triton warps per program; BLOCK and WARPS are the fastest tried on an H200 at GPT-2's vocabulary


def softmax_grad(logits: Float[Array, "C V"], targets: Int[Array, "C"], real: Float[Array, "C"], out_dtype, *,
                 interpret: bool = False) -> tuple[Float[Array, "C V"], Float[Array, "C"]]:
  """(softmax(logits) - onehot(targets)) * real as out_dtype, and -log softmax(logits)[target] (float32);
  real is 1 for a token and 0 for padding. A padding row's loss is 0, and its gradient row 0 where the
  row is finite (head_cross_entropy pads with zero logits). A token whose target lies outside [0, V)
  (unchecked under jit) gets a NaN loss and softmax as its gradient row."""
  kernel = functools.partial(_kernel, blocks=-(-logits.shape[1] // BLOCK))
  return tiling.row_call(kernel, logits, targets, real, out_dtype, 1, warps=WARPS, interpret=interpret)


def _kernel(x_ref, t_ref, real_ref, g_ref, nll_ref, *, blocks: int):
  """One row: x_ref (V,) logits, t_ref (1,) target, real_ref (1,); g_ref (V,), nll_ref (1,).

  Each of the BLOCK lanes keeps its own running max and sum(exp(x - max)) over the logits it
  sees (lane i: logits i, BLOCK + i, ...); they are combined once at the end, so the sweeps
  have no cross-thread reduction inside the loop and one exp per logit each."""
  t, real = t_ref[...], real_ref[...]  # (1,), (1,)
  lane = jnp.arange(BLOCK)  # (BLOCK,)
  load = lambda j: tiling.row_block(x_ref, j, lane)  # (BLOCK,) float32 logits (-inf past V), indices, mask

  def sweep_max_sum(j, carry):  # per lane: (m, s) with the new logit x folded in (online softmax)
    m, s = carry  # (BLOCK,), (BLOCK,)
    x, _, valid = load(j)
    e = jnp.where(x == m, 1.0, jnp.exp(-jnp.abs(x - m)))  # exp(smaller - larger); equal (also -inf): 1
    s_new = jnp.where(x > m, s * e + 1.0, s + e)
    return jnp.where(valid, jnp.maximum(m, x), m), jnp.where(valid, s_new, s)

  init = (jnp.full((BLOCK,), -jnp.inf, jnp.float32), jnp.zeros((BLOCK,), jnp.float32))
  m_lane, s_lane = jax.lax.fori_loop(0, blocks, sweep_max_sum, init)
  m = jnp.max(m_lane)  # the row's max
  s = jnp.sum(jnp.where(s_lane > 0, s_lane * jnp.exp(m_lane - m), 0.0))  # sum(exp(x - m)) >= 1
  inv = real / s  # (1,) 1 / sum(exp(x - m)) for tokens, 0 for padding

  def sweep_grad(j, target):  # softmax - onehot, written; the target's logit, collected per lane
    x, idx, valid = load(j)
    hit = idx == t  # (BLOCK,)
    g = jnp.exp(x - m) * inv - jnp.where(hit, real, 0.0)
    plgpu.store(g_ref.at[pl.ds(j * BLOCK, BLOCK)], g.astype(g_ref.dtype), mask=valid)
    return target + jnp.where(hit, x, 0.0)

  target = jnp.sum(jax.lax.fori_loop(0, blocks, sweep_grad, jnp.zeros((BLOCK,), jnp.float32)))
  nll_ref[...] = (jnp.log(s) - (target - m)) * real  # (1,)
