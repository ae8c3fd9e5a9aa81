"""AdamW with linear warm-up, cosine decay, global-norm clipping, weight decay on matrices only."""

from __future__ import annotations

import jax
import optax


def schedule(lr: float, steps: int, warmup: int) -> optax.Schedule:
  warmup = max(1, min(warmup, steps))
  return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, decay_steps=max(steps, warmup + 1), end_value=0.1 * lr)


def adamw(lr: float, steps: int, warmup: int, *, weight_decay: float = 0.1, clip: float = 1.0,
          b1: float = 0.9, b2: float = 0.95) -> optax.GradientTransformation:
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on biases, norms
  return optax.chain(
      optax.clip_by_global_norm(clip),
      optax.adamw(schedule(lr, steps, warmup), b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
  )
