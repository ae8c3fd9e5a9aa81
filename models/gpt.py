"""A GPT-2-style decoder in Flax NNX on attnlayers' attention.

Pre-norm blocks (LayerNorm -> attention -> residual, LayerNorm -> GELU MLP -> residual),
learned absolute positions, token embedding tied to the output projection, GPT-2's
initialisation (normal 0.02, residual projections scaled by 1/sqrt(2 * n_layer)). The
attention kernel is `config.backend`; the model never branches on it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from attnlayers.nnx import MultiHeadAttention
from models.config import GPTConfig


class Block(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    proj_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer))
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    self.ln1 = nnx.LayerNorm(cfg.d_model, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.attn = MultiHeadAttention(
        cfg.n_head, cfg.d_model, num_kv_heads=cfg.n_kv_head, backend=cfg.backend, is_causal=cfg.causal,
        decode=False, dtype=dt, param_dtype=pdt, kernel_init=init, out_kernel_init=proj_init, rngs=rngs)
    self.ln2 = nnx.LayerNorm(cfg.d_model, dtype=dt, param_dtype=pdt, rngs=rngs)
    hidden = cfg.mlp_ratio * cfg.d_model
    self.fc = nnx.Linear(cfg.d_model, hidden, dtype=dt, param_dtype=pdt, kernel_init=init, rngs=rngs)
    self.proj = nnx.Linear(hidden, cfg.d_model, dtype=dt, param_dtype=pdt, kernel_init=proj_init, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout)

  def __call__(self, x: Float[Array, "B T D"], rngs: nnx.Rngs | None = None) -> Float[Array, "B T D"]:
    drop = lambda y: self.dropout(y, deterministic=rngs is None, rngs=rngs)
    x = x + drop(self.attn(self.ln1(x)))
    return x + drop(self.proj(jax.nn.gelu(self.fc(self.ln2(x)))))


class GPT(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(0.02)
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    # Lookups run in the parameter dtype and are cast after: their gradient is a scatter-add,
    # which on GPUs is native in float32 but emulated (and ~30x slower, measured) in bfloat16.
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=pdt, param_dtype=pdt, embedding_init=init, rngs=rngs)
    self.wpe = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=pdt, param_dtype=pdt, embedding_init=init, rngs=rngs)
    self.drop = nnx.Dropout(cfg.dropout)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)])
    self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dt, param_dtype=pdt, kernel_init=init, rngs=rngs)

  def __call__(self, tokens: Int[Array, "B T"], rngs: nnx.Rngs | None = None) -> Float[Array, "B T V"]:
    """Float32 logits; `rngs` (with a 'dropout' stream) turns dropout on, None is deterministic."""
    T = tokens.shape[1]
    if T > self.cfg.seq_len:
      raise ValueError(f"sequence of {T} tokens is longer than the model's seq_len ({self.cfg.seq_len})")
    dt = jnp.dtype(self.cfg.dtype)
    x = (self.wte(tokens) + self.wpe(jnp.arange(T))).astype(dt)  # (B, T, D)
    x = self.drop(x, deterministic=rngs is None, rngs=rngs)
    for block in self.blocks:
      x = block(x, rngs)
    x = self.ln_f(x)
    if self.head is None:  # tied: the token embedding, in the compute dtype, as output projection
      logits = jnp.einsum("btd,vd->btv", x, self.wte.embedding[...].astype(dt))  # (B, T, V)
    else:
      logits = self.head(x)
    return logits.astype(jnp.float32)


def count_params(model: GPT, *, exclude_positions: bool = True) -> int:
  """Parameters as nanoGPT counts them for FLOPs: tied embeddings once, positions excluded."""
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return n - (model.wpe.embedding.size if exclude_positions else 0)


def flops_per_token(cfg: GPTConfig, n_params: int, seq_len: int) -> float:
  """Training FLOPs per token: 6N for the matmuls with parameters (forward + backward) plus
  12 * L * n_head * head_dim * T for attention scores and values (PaLM appendix B / nanoGPT;
  counts the full T x T square, also for causal)."""
  return 6 * n_params + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len
