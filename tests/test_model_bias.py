"""GPTConfig.bias False (python -m train --no-bias, nanoGPT's bias=False): a model without any bias computes
what the biased model computes with its biases at zero, trains, resumes only as itself, and samples."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import models
from tests import reference
from sample import cli as sample_cli
from train import checkpoint, reader
from train.step import batch_loss
from tests.test_train import SMALL, train_cli


def _loss_and_grads(cfg, batch, weights: dict | None = None):
  """The training loss and its gradient; weights: {keystr path: value} to set (every parameter they name), and
  every other parameter (a bias) set to 0."""
  graphdef, params, fp8 = nnx.split(models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
  params = nnx.to_pure_dict(params)
  if weights is not None:
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: weights.get(jax.tree_util.keystr(p), jnp.zeros_like(x)), params)
  loss = lambda p: batch_loss(graphdef, nnx.State(p), fp8, batch, None)
  return params, jax.jit(jax.value_and_grad(loss))(params)


def _paths(tree) -> dict:
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("kernel", ["xla", "interpret"])
def test_without_biases_is_the_biased_model_with_zero_biases(kernel):
  """Loss and every shared parameter's gradient equal the biased model's with the same weights and each bias set to
  0 (float32), on XLA's fusions and the Pallas kernels (interpreted)."""
  cfg = dataclasses.replace(models.preset("tiny", seq_len=16), kernels=kernel)
  x = jax.random.randint(jax.random.key(1), (3, 16), 0, cfg.vocab_size)  # (B, T)
  batch = {"inputs": x, "targets": jnp.roll(x, -1, axis=1)}
  weights, (loss_nb, g_nb) = _loss_and_grads(dataclasses.replace(cfg, bias=False), batch)
  _, (loss_zb, g_zb) = _loss_and_grads(cfg, batch, weights=_paths(weights))
  g_nb, g_zb = _paths(g_nb), _paths(g_zb)
  assert not [k for k in g_nb if "bias" in k] and {k for k in g_zb if "bias" not in k} == set(g_nb)
  reference.assert_close(loss_nb, loss_zb, jnp.float32, "out", "loss")
  for k, g in g_nb.items():
    reference.assert_close(g, g_zb[k], jnp.float32, "grad", k)


def test_bias_must_be_a_bool():
  with pytest.raises(ValueError, match="bias must be True .* or False .*; got 'no'"):
    models.preset("tiny", bias="no")


def test_no_bias_trains_resumes_only_as_itself_and_restores(tmp_path):
  ckpt = ["--ckpt-dir", str(tmp_path / "c"), "--ckpt-every", "2"]
  rc, out, err = train_cli(*SMALL, "--steps", "2", "--no-bias", *ckpt)
  assert rc == 0 and ", no bias" in out.splitlines()[0], err  # the model line
  rc, _, err = train_cli(*SMALL, "--steps", "4", "--allow-change", "steps", *ckpt)  # the preset's biases
  assert rc == 2 and "model.bias: checkpoint False, now True (python -m train sets it with --bias / --no-bias)" in err, err
  rc, out, err = train_cli(*SMALL, "--steps", "4", "--allow-change", "steps", "--no-bias", *ckpt)
  assert rc == 0 and "at step 2" in out, err
  restored = sample_cli.restore(str(tmp_path / "c"), "xla")
  assert restored.step == 4 and restored.model.cfg.bias is False
  assert not [k for k in _paths(nnx.to_pure_dict(nnx.state(restored.model, nnx.Param))) if "bias" in k]


def test_sample_rebuilds_a_checkpoint_from_before_the_bias_setting_with_biases(tmp_path, monkeypatch):
  """A checkpoint whose architecture has no "bias" (written before it existed) is restored as a biased model."""
  assert train_cli(*SMALL, "--steps", "2", "--ckpt-dir", str(tmp_path / "c"))[0] == 0
  read = reader.Reader.meta

  def without_bias(self, step):  # the checkpoint's meta as an older trainer wrote it
    meta = read(self, step)
    meta["model"].pop("bias")
    return meta
  monkeypatch.setattr(reader.Reader, "meta", without_bias)
  restored = sample_cli.restore(str(tmp_path / "c"), "xla")
  assert restored.model.cfg.bias is True and restored.model.blocks[0].fc.bias is not None


def test_a_checkpoint_from_before_the_bias_setting_had_biases(tmp_path):
  now = {"model": models.preset("tiny").architecture(), "seed": 0, "pack": False}
  old = now | {"model": {k: v for k, v in now["model"].items() if k != "bias"}}
  assert checkpoint.check_meta(str(tmp_path), 5, old, now) == {}
  without = now | {"model": models.preset("tiny", bias=False).architecture()}
  with pytest.raises(checkpoint.ResumeMismatchError, match="model.bias: checkpoint True, now False"):
    checkpoint.check_meta(str(tmp_path), 5, old, without)
