"""AdamW with linear warm-up, cosine decay, global-norm clipping, weight decay on kernels and embeddings only."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import optax


# The schedule's rule, recorded in checkpoints (a resume on another rule would not continue the run). Runs
# before it was recorded warmed up from 0 and ended their cosine a step after their last (checkpoint.ABSENT_RUN).
LR_SCHEDULE = "warm-up lr * (s + 1) / (warmup + 1), cosine to lr / 10 at the last step"
# Which parameters weight decay applies to, recorded in checkpoints too. Runs before it was recorded decayed every
# parameter of 2 or more dimensions, the attention's (heads, head_dim) q/k/v biases among them (checkpoint.ABSENT_RUN).
DECAY_RULE = "kernels and embeddings (the token and position tables); no biases or LayerNorm scales"
DECAYED = ("kernel", "embedding")  # the parameter names DECAY_RULE decays


def decays(params):
  """A tree of bools like `params` (the model's parameters, an nnx.State or a nested dict): True where weight decay
  applies (DECAY_RULE), by each parameter's name. nanoGPT decays every parameter of 2 or more dimensions, which in
  its model are the same ones; here the q/k/v biases are (heads, head_dim) arrays, and not decayed."""
  def name(path):  # the parameter's name: the last dict key of its path (nnx.State adds a .value attribute after it)
    return next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))
  return jax.tree_util.tree_map_with_path(lambda path, p: name(path) in DECAYED, params)


def schedule(lr: float, steps: int, warmup: int) -> optax.Schedule:
  """nanoGPT's learning rate at 0-based step s of a run of `steps` updates (nanoGPT's max_iters = lr_decay_iters
  = steps - 1: its loop runs max_iters + 1): lr * (s + 1) / (warmup + 1) for the first `warmup` steps (the first
  update already moves, at lr / (warmup + 1); a warm-up from 0 would spend it at lr 0), then a cosine decay to
  0.1 * lr at the last step, s = steps - 1. warmup 0: the cosine from lr at step 0. A warm-up longer than the
  run is cut to `steps`."""
  warmup = min(warmup, steps)
  decay_steps = max(steps - 1, warmup + 1)
  if warmup == 0:
    return optax.cosine_decay_schedule(lr, decay_steps, alpha=0.1)
  return optax.warmup_cosine_decay_schedule(lr / (warmup + 1), lr, warmup, decay_steps=decay_steps,
                                            end_value=0.1 * lr)


def global_norm(tree) -> jax.Array:
  """The L2 norm of every leaf together (float32, or float64 for float64 leaves), summed one group of
  leaves of the same shape and dtype at a time; optax.tree.norm's sum, in another order. Leaves must be
  real floating point.

  optax sums each leaf on its own: one small reduction kernel, and a memset for its scalar, per leaf
  (196 for gpt2-small). Grouped, the same leaves are 9 reductions (the same parameter of every block,
  stacked)."""
  groups = collections.defaultdict(list)
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"global_norm takes real floating-point leaves; {jax.tree_util.keystr(path)} is {x.dtype}")
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    groups[x.shape, dtype].append(x.astype(dtype))
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
  """Clipping by the grouped global norm, then optax's AdamW, parameter by parameter.

  AdamW stays per parameter: inside the jitted step XLA fuses the per-leaf updates, so stacking the
  groups buys nothing there (benchmarks/results/h200/code-measurements.md holds the timings)."""
  return optax.chain(
      clip_by_global_norm(clip),
      optax.adamw(schedule(lr, steps, warmup), b1=b1, b2=b2, weight_decay=weight_decay, mask=decays),
  )
