"""The GPT against the same parameters run through the plain Flax modules (nnx.LayerNorm, the attention layer's
own call with its output bias, nnx.Linear, jax.nn.gelu, the tied logits and optax's cross-entropy), in float32
with every bias non-zero: loss and every parameter's gradient, on XLA's fusions and the Pallas kernels
(interpreted). What the model fuses (the residual adds into its LayerNorms, the branches' output biases into
them, bias + GELU, the chunked loss) must not change what it computes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import models
from tests import reference
from train.step import batch_loss


def _plain_loss(model: models.GPT, batch: dict) -> jax.Array:
  """The GPT's training loss written with the plain modules, float32 (dropout off)."""
  T = batch["inputs"].shape[1]
  x = model.wte(batch["inputs"]) + model.wpe(jnp.arange(T)[None])  # (B, T, D)
  for block in model.blocks:
    x = x + block.attn(block.ln1(x))
    x = x + block.proj(jax.nn.gelu(block.fc(block.ln2(x)), approximate=True))
  logits = model.ln_f(x) @ model.wte.embedding[...].T  # (B, T, V)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


@pytest.mark.parametrize("kernel", ["xla", "interpret"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_gpt_loss_and_gradients_are_the_plain_modules(kernel, bias):
  cfg = dataclasses.replace(models.preset("tiny", seq_len=16), kernels=kernel, bias=bias)
  model = models.GPT(cfg, rngs=nnx.Rngs(0))
  graphdef, params, fp8 = nnx.split(model, nnx.Param, ...)
  params = nnx.to_pure_dict(params)
  keys = iter(jax.random.split(jax.random.key(7), 64))
  params = jax.tree_util.tree_map_with_path(  # every bias and LayerNorm scale away from its initial 0 or 1
      lambda p, a: a + 0.2 * jax.random.normal(next(keys), a.shape) if p[-1].key in ("bias", "scale") else a, params)
  x = jax.random.randint(jax.random.key(1), (3, 16), 0, cfg.vocab_size)  # (B, T)
  batch = {"inputs": x, "targets": jnp.roll(x, -1, axis=1)}
  loss, grads = jax.jit(jax.value_and_grad(lambda p: batch_loss(graphdef, nnx.State(p), fp8, batch, None)))(params)
  plain = lambda p: _plain_loss(nnx.merge(graphdef, nnx.State(p), fp8), batch)
  want, want_grads = jax.jit(jax.value_and_grad(plain))(params)
  reference.assert_close(loss, want, jnp.float32, "out", "loss")
  flat = lambda tree: {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(tree)}
  got, want_grads = flat(grads), flat(want_grads)
  assert set(got) == set(want_grads) and any("attn']['out']['bias" in k for k in got) == bias
  for k, g in want_grads.items():
    reference.assert_close(got[k], g, jnp.float32, "grad", k)
