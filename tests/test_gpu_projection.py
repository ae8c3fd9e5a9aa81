"""On an NVIDIA GPU: compiled as the trainer compiles (train.step.STEP_COMPILER_OPTIONS), the biases
of the attention layer's four projections and of the GPT's MLP output run in cuBLASLt epilogues, and so
does the GELU of a GPT without biases (models.ops.bias_gelu.gelu_of_gemm)."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import models
from attnlayers.nnx import MultiHeadAttention
from train.step import STEP_COMPILER_OPTIONS

pytestmark = pytest.mark.gpu
BIAS_EPILOGUE = re.compile(r'"epilogue":"BIAS"')
GELU_EPILOGUE = re.compile(r'"epilogue":"GELU_AUX"')


def _fused_biases(module, x, epilogue=BIAS_EPILOGUE) -> int:
  """cuBLASLt calls with a bias epilogue (or `epilogue`) in the compiled forward + backward of sum(module(x)^2)
  (a square, so that the gradient needs the output's value and its GEMM stays in the program)."""
  graphdef, params = nnx.split(module)
  loss = lambda params, x: jnp.square(nnx.merge(graphdef, params)(x).astype(jnp.float32)).sum()
  fn = jax.jit(jax.grad(loss), compiler_options=STEP_COMPILER_OPTIONS)
  return len(epilogue.findall(fn.lower(params, x).compile().as_text()))


def test_the_layers_q_k_v_and_out_biases_run_in_the_gemms():
  """Flax's own layer, compiled the same way, keeps its (N, H) q/k/v biases as separate passes."""
  kwargs = dict(num_heads=12, in_features=768, num_kv_heads=4, decode=False, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(0), (2, 256, 768), jnp.bfloat16)  # (B, T, D)
  ours = MultiHeadAttention(**kwargs, backend="cudnn", is_causal=True, rngs=nnx.Rngs(0))
  assert _fused_biases(ours, x) == 4
  # Flax's: its output projection's bias only (1 on the H200 with jax 0.11.2); should XLA learn to fuse
  # an (N, H) bias, this fails, and attnlayers.projection is no longer needed
  assert _fused_biases(nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0)), x) < 4


def test_every_block_bias_but_the_mlp_input_runs_in_a_gemm():
  """q, k, v, attention out, MLP out: 5 per block (the MLP input's bias is in models.ops.bias_gelu's kernel)."""
  cfg = models.preset("gpt2-small", n_layer=2, seq_len=256, backend="cudnn")
  model = models.GPT(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((2, 256), jnp.int32)
  assert _fused_biases(_Hidden(model), tokens) == 5 * cfg.n_layer


class _Hidden(nnx.Module):
  def __init__(self, model):
    self.model = model

  def __call__(self, tokens):
    return self.model.hidden(tokens)


@pytest.mark.parametrize("bias", [False, True], ids=["without", "with"])
def test_without_biases_the_mlp_gelu_runs_in_the_fc_gemm(bias):
  """GELU_AUX (gelu(z) and z from the fc GEMM) once per block without biases; with them bias_gelu's kernel."""
  cfg = models.preset("gpt2-small", n_layer=2, seq_len=256, backend="cudnn", bias=bias)
  tokens = jnp.zeros((2, 256), jnp.int32)
  assert _fused_biases(_Hidden(models.GPT(cfg, rngs=nnx.Rngs(0))), tokens, GELU_EPILOGUE) == (0 if bias else 2)
