"""train.optim: the grouped global norm and the clip built on it against optax's own; the learning-rate schedule
against nanoGPT's."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train import optim


def _grads(scale: float) -> dict:
  """A tree with shapes repeated across 'blocks' (as a GPT's parameters) and ones that occur once, named as the
  model's: kernels, biases (one of them 2-D, as the attention's q/k/v biases), an embedding and a scale."""
  keys = iter(jax.random.split(jax.random.key(0), 24))
  block = lambda: {"fc": {"kernel": jax.random.normal(next(keys), (8, 12)), "bias": jax.random.normal(next(keys), (12,))},
                   "query": {"kernel": jax.random.normal(next(keys), (8, 4, 3)),
                             "bias": jax.random.normal(next(keys), (4, 3))}}
  return jax.tree.map(lambda x: x * scale, {"blocks": [block() for _ in range(3)],
                                            "wte": {"embedding": jax.random.normal(next(keys), (20, 8))},
                                            "ln": {"scale": jax.random.normal(next(keys), ())}})


def _optax_adamw():
  """What optim.adamw(1e-2, 10, 2) is written from: optax's clip and AdamW, decay on kernels and embeddings."""
  mask = lambda ps: jax.tree_util.tree_map_with_path(lambda path, p: path[-1].key in ("kernel", "embedding"), ps)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optim.schedule(1e-2, 10, 2), b1=0.9, b2=0.95,
                     weight_decay=0.1, mask=mask))


def test_weight_decay_applies_to_the_model_s_kernels_and_embeddings_only():
  """On a GPT's parameters (an nnx.State): every kernel and embedding decays; no bias (the (heads, head_dim) q/k/v
  biases included, which nanoGPT's 2-D rule would decay) and no LayerNorm scale."""
  import models
  from flax import nnx
  params = nnx.state(models.GPT(models.preset("tiny"), rngs=nnx.Rngs(0)), nnx.Param)
  flags = {jax.tree_util.keystr(p): (f, x.ndim) for (p, f), x in zip(
      jax.tree_util.tree_leaves_with_path(optim.decays(params)), jax.tree.leaves(params))}
  decayed = {k for k, (f, _) in flags.items() if f}
  assert decayed == {k for k in flags if "'kernel'" in k or "'embedding'" in k}
  assert any(ndim == 2 and "'bias'" in k for k, (f, ndim) in flags.items())  # such biases exist, and are not decayed


def test_global_norm_is_optax_tree_norm():
  g = _grads(1.0)
  np.testing.assert_allclose(float(optim.global_norm(g)), float(optax.tree.norm(g)), rtol=1e-6)


@pytest.mark.parametrize("scale", [1e-3, 10.0], ids=["below max_norm", "above max_norm"])
def test_clip_scales_as_optax_clip_by_global_norm(scale):
  g = _grads(scale)
  ours, _ = jax.jit(optim.clip_by_global_norm(1.0).update)(g, optax.EmptyState())
  theirs, _ = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
  norm = float(optax.tree.norm(ours))
  assert norm == pytest.approx(min(1.0, float(optax.tree.norm(g))), rel=1e-5)


def test_adamw_steps_as_the_optax_chain_it_replaces():
  params = _grads(1.0)
  ref = _optax_adamw()
  ours = optim.adamw(1e-2, 10, 2)
  p_ref, p_ours, s_ref, s_ours = params, params, ref.init(params), ours.init(params)
  for i in range(4):
    g = _grads(3.0 ** i)  # clipped from the second step on
    u, s_ref = ref.update(g, s_ref, p_ref)
    p_ref = optax.apply_updates(p_ref, u)
    u, s_ours = ours.update(g, s_ours, p_ours)
    p_ours = optax.apply_updates(p_ours, u)
  for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_mixed_dtypes_are_summed_in_their_promoted_dtype_and_non_floats_refused():
  g = {"a": jnp.full((4,), 3.0, jnp.bfloat16), "b": jnp.full((4,), 4.0, jnp.float32)}  # same shape, two groups
  assert float(optim.global_norm(g)) == pytest.approx(float(optax.tree.norm(g)), rel=1e-6)
  with pytest.raises(ValueError, match=r"\['n'\] is int32"):
    optim.global_norm({"n": jnp.ones((2,), jnp.int32)})


def test_the_chain_state_has_optax_s_structure_so_earlier_checkpoints_restore():
  params = _grads(1.0)
  ref = _optax_adamw()
  assert jax.tree.structure(optim.adamw(1e-2, 10, 2).init(params)) == jax.tree.structure(ref.init(params))


def _nanogpt_lr(it: int, lr: float, warmup: int, decay_iters: int) -> float:
  """nanoGPT's get_lr (train.py), min_lr = lr / 10, lr_decay_iters = the run's steps."""
  if it < warmup:
    return lr * (it + 1) / (warmup + 1)
  if it > decay_iters:
    return lr / 10
  coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (decay_iters - warmup)))
  return lr / 10 + coeff * (lr - lr / 10)


@pytest.mark.parametrize("steps, warmup", [(50, 10), (20, 0), (7, 1)], ids=["warm-up", "none", "one step"])
def test_schedule_is_nanogpts_and_the_first_update_moves(steps, warmup):
  """nanoGPT runs iterations 0..max_iters: a run of `steps` updates is its max_iters = lr_decay_iters = steps - 1."""
  lr_at = optim.schedule(6e-4, steps, warmup)
  got = [float(lr_at(i)) for i in range(steps)]
  np.testing.assert_allclose(got, [_nanogpt_lr(i, 6e-4, warmup, steps - 1) for i in range(steps)], rtol=1e-5)
  assert got[0] > 0 and got[-1] == pytest.approx(6e-5, rel=1e-5)  # the last step at lr / 10


def test_a_warmup_longer_than_the_run_is_cut_to_it():
  lr_at = optim.schedule(1.0, 3, 5)
  np.testing.assert_allclose([float(lr_at(i)) for i in range(3)], [1 / 4, 2 / 4, 3 / 4], rtol=1e-6)
