"""AdamW with linear warm-up, cosine decay, global-norm clipping, weight decay on matrices only."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import optax


def schedule(lr: float, steps: int, warmup: int) -> optax.Schedule:
  warmup = max(1, min(warmup, steps))
  return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, decay_steps=max(steps, warmup + 1), end_value=0.1 * lr)


def global_norm(tree) -> jax.Array:
  """The L2 norm of every leaf together, float32, summed one group of same-shaped leaves at a time.

  optax.global_norm sums each leaf on its own: for gpt2-small's 196 leaves that is ~200 small
  reduction kernels and a memset per scalar, ~1.2 ms of a ~64 ms step on the H200. Stacking the leaves
  that share a shape (the same parameter of every block) leaves 16 reductions; over 8 rounds of the
  cudnn training step (B=32, T=1024) alternating the two in one process, the step's median went from
  64.79 ms to 63.86 ms. The same sum, in another order."""
  groups = collections.defaultdict(list)
  for x in jax.tree.leaves(tree):
    groups[x.shape].append(x.astype(jnp.float32))
  return jnp.sqrt(sum(jnp.sum(jnp.square(jnp.stack(xs))) for xs in groups.values()))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm, with the norm of `global_norm`: updates scaled by max_norm / norm where the
  norm exceeds max_norm, as optax scales them."""

  def update(updates, state, params=None):
    del params
    norm = global_norm(updates)
    clip = lambda t: jax.lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm)
    return jax.tree.map(clip, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def adamw(lr: float, steps: int, warmup: int, *, weight_decay: float = 0.1, clip: float = 1.0,
          b1: float = 0.9, b2: float = 0.95) -> optax.GradientTransformation:
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on biases, norms
  return optax.chain(
      clip_by_global_norm(clip),
      optax.adamw(schedule(lr, steps, warmup), b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
  )
