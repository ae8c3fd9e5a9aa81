"""A GPT-2-style decoder in Flax NNX on attnlayers' attention.

Pre-norm blocks (LayerNorm -> attention -> residual, LayerNorm -> GELU MLP -> residual; the
stream passes from block to block as a pair whose sum it is, which the next LayerNorm adds in
its own pass: models.ops.layernorm), learned absolute positions, token embedding tied to the output projection, GPT-2's
initialisation (normal 0.02, residual projections scaled by 1/sqrt(2 * n_layer)); `config.bias`
False drops every Linear's and LayerNorm's bias (nanoGPT's bias=False). The
attention kernel is `config.backend`; the model never branches on it, except that
backend "te-fp8" means FP8 for the whole model: the attention projections (q/k/v as one
GEMM) and both MLP GEMMs run as TransformerEngine FP8 GEMMs, each with its own delayed-
scaling state; the logits head stays bf16 (the largest GEMM's output feeds the softmax).

Packed documents: `model(tokens, segment_ids=ids, positions=pos)` runs several documents in
one row; every block's attention lets a token see only its own document's tokens (ids (B, T),
1, 2, ... per document, 0 = padding), and `pos` (B, T) indexes the position table, restarting
at 0 where a document starts. Each document then computes what it computes alone in a row.
Sliding windows: `config.window` (N tokens: the query and the N - 1 before it) on the layers
`config.window_pattern` marks "local" (every layer where it is None); the layer applies it with or without a cache.

Decoding: `init_cache(batch, max_length)` gives every block's attention a KV cache; then
`model(tokens, decode=True, lengths=...)` runs T new tokens per row (a whole prompt chunk
or one token) at each row's own position, read from the cache. models.generate drives it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx
from jaxtyping import Array, Float, Int

from attnlayers import projection
from attnlayers.fp8 import FP8Recipe, use_fp8_dense
from attnlayers.nnx import MultiHeadAttention
from models import fused_decode
from models.config import GPTConfig
from models.ops.bias_gelu import bias_gelu, gelu_of_gemm
from models.ops.layernorm import residual_norm


def axes(*names: str) -> dict:
  """A parameter's logical axis names as Flax's sharding metadata (`out_sharding`, what nnx.with_partitioning
  sets), for a layer's `*_metadata` argument. A mesh's rules map them to its axes (train.mesh.RULES); the
  parameter is made as it is without a mesh (eager_sharding off), so the model runs on no mesh too."""
  return {"out_sharding": names, "eager_sharding": False}


def _layer_norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(cfg.d_model, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                       use_bias=cfg.bias, scale_metadata=axes("norm"), bias_metadata=axes("norm"), rngs=rngs)


class Block(nnx.Module):
  def __init__(self, cfg: GPTConfig, layer: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    proj_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer))
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    self.max_segments = cfg.max_segments  # bound on documents per packed row (attnlayers max_segments)
    self.kernels = cfg.kernels  # its LayerNorms' and bias + GELU's (models.ops)
    self.ln1 = _layer_norm(cfg, rngs)
    recipe = FP8Recipe(core=cfg.fp8_core) if cfg.backend == "te-fp8" else None  # te-fp8: every GEMM but the head
    self.attn = MultiHeadAttention(
        cfg.n_head, cfg.d_model, num_kv_heads=cfg.n_kv_head, backend=cfg.backend, is_causal=cfg.causal,
        decode=False, sliding_window=cfg.layer_window(layer), dtype=dt, param_dtype=pdt, use_bias=cfg.bias,
        kernel_init=init, out_kernel_init=proj_init, fp8_recipe=recipe, rngs=rngs,
        kernel_metadata=axes("embed", "heads", "head_dim"), bias_metadata=axes("heads", "head_dim"),
        out_kernel_metadata=axes("heads", "head_dim", "embed"), out_bias_metadata=axes("embed"))
    for proj in (self.attn.key, self.attn.value):  # Flax's layer gives q, k and v one kernel_metadata
      proj.kernel.set_metadata(out_sharding=("embed", "kv_heads", "head_dim"))
      if proj.bias is not None:
        proj.bias.set_metadata(out_sharding=("kv_heads", "head_dim"))
    self.ln2 = _layer_norm(cfg, rngs)
    hidden = cfg.mlp_ratio * cfg.d_model
    self.fc = nnx.Linear(cfg.d_model, hidden, dtype=dt, param_dtype=pdt, use_bias=cfg.bias, kernel_init=init,
                         kernel_metadata=axes("embed", "mlp"), bias_metadata=axes("mlp"), rngs=rngs)
    self.proj = nnx.Linear(hidden, cfg.d_model, dtype=dt, param_dtype=pdt, use_bias=cfg.bias,
                           kernel_init=proj_init, kernel_metadata=axes("mlp", "embed"), bias_metadata=axes("embed"),
                           rngs=rngs)
    if recipe is not None:  # the MLP's two GEMMs (two thirds of the block's matmul FLOPs) in FP8 too
      use_fp8_dense(self.fc, recipe)
      use_fp8_dense(self.proj, recipe)
    self.fp8 = recipe is not None
    self.gelu_in_gemm = recipe is None and not cfg.bias  # GELU in the fc GEMM's epilogue (models.ops.bias_gelu)
    self.dropout = nnx.Dropout(cfg.dropout)

  def __call__(self, x: Float[Array, "B T D"], y: Float[Array, "B T D"] | None = None, rngs: nnx.Rngs | None = None,
               *, decode: bool = False, lengths: Int[Array, "B"] | None = None,
               segment_ids: Int[Array, "B T"] | None = None) -> tuple[Float[Array, "B T D"], Float[Array, "B T D"]]:
    """The residual stream in and out as a pair whose sum it is, (x, y) (y None: x alone), so that each
    LayerNorm adds the pair in its own pass: returns (x + y + attention, the MLP's output)."""
    if decode and (kernel := fused_decode.fusable(self, x, lengths=lengths, rngs=rngs)):
      return fused_decode.step(self, x, y, kernel)  # one token per row: few kernels (models.fused_decode)
    drop = lambda a: self.dropout(a, deterministic=rngs is None, rngs=rngs)
    x, h = residual_norm(self.ln1, x, y, kernel=self.kernels)  # x + y, and its LayerNorm
    packed = {} if segment_ids is None or self.max_segments is None else {"max_segments": self.max_segments}
    a = drop(self.attn(h, decode=True, lengths=lengths) if decode else self.attn(h, segment_ids=segment_ids, **packed))
    x, h = residual_norm(self.ln2, x, a, kernel=self.kernels)
    # (B, T, 4D); its bias is added in bias_gelu's pass (none under te-fp8: zeros)
    z = _placed(_unbiased(self.fc, h), "mlp")
    if self.gelu_in_gemm:
      return x, drop(self.proj(gelu_of_gemm(z, kernel=self.kernels)))
    b = jnp.zeros(z.shape[-1:], z.dtype) if self.fc.bias is None else self.fc.bias[...].astype(z.dtype)  # (4D,)
    return x, drop(self.proj(bias_gelu(z, b, kernel=self.kernels)))


def _placed(a: Float[Array, "B T F"] | None, features: str | None = None) -> Float[Array, "B T F"] | None:
  """`a` where Flax's logical axis rules (a mesh's, train.mesh) put ("batch", "length", `features`): rows split
  as the batch is, features by their name (None: whole on every device); as it is without rules. The residual
  stream at each block and the MLP's hidden layer: left to itself, the partitioner gathers the batch for some
  of FSDP's products instead of the weights."""
  if a is None or a.ndim != 3:
    return a
  return linen.with_logical_constraint(a, ("batch", "length", features),
                                       fallback=linen.spmd.RulesFallback.NO_CONSTRAINT)


def _unbiased(linear: nnx.Linear, x: Float[Array, "B T D"]) -> Float[Array, "B T F"]:
  """What `linear(x)` computes before its bias add: x @ kernel in the compute dtype, through the module's own
  dot_general (an FP8 GEMM under te-fp8)."""
  x, kernel = linear.promote_dtype((x, linear.kernel[...]), dtype=linear.dtype)
  extra = {} if linear.preferred_element_type is None else {"preferred_element_type": linear.preferred_element_type}
  return projection.dense(x, kernel, dot_general=linear.dot_general, precision=linear.precision, **extra)


class GPT(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(0.02)
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    # Lookups run in the parameter dtype and are cast after: their gradient is a scatter-add,
    # which on GPUs is native in float32 but emulated, and far slower, in bfloat16.
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=pdt, param_dtype=pdt, embedding_init=init,
                         embedding_metadata=axes("vocab", "embed"), rngs=rngs)
    self.wpe = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=pdt, param_dtype=pdt, embedding_init=init,
                         embedding_metadata=axes("position", "embed"), rngs=rngs)
    self.drop = nnx.Dropout(cfg.dropout)
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layer)])
    self.ln_f = _layer_norm(cfg, rngs)
    self.head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dt, param_dtype=pdt, kernel_init=init,
        kernel_metadata=axes("embed", "vocab"), rngs=rngs)

  def init_cache(self, batch: int, max_length: int, dtype=None) -> None:
    """An empty KV cache of `max_length` positions for `batch` rows in every block (dtype: the compute dtype)."""
    if not 1 <= max_length <= self.cfg.seq_len:
      raise ValueError(f"max_length ({max_length}) must be in [1, seq_len={self.cfg.seq_len}]: positions past "
                       "the model's context have no position embedding")
    for block in self.blocks:
      block.attn.init_cache((batch, max_length, self.cfg.d_model), dtype=dtype)

  def __call__(self, tokens: Int[Array, "B T"], rngs: nnx.Rngs | None = None, *, decode: bool = False,
               lengths: Int[Array, "B"] | None = None, last_only: bool = False,
               segment_ids: Int[Array, "B T"] | None = None,
               positions: Int[Array, "B T"] | None = None) -> Float[Array, "B T V"]:
    """Float32 logits: `hidden` (same arguments) times `head_weight`. Training takes the two apart
    (models.loss.head_cross_entropy) so that the (B, T, V) logits never exist at once."""
    x = self.hidden(tokens, rngs, decode=decode, lengths=lengths, last_only=last_only, segment_ids=segment_ids,
                    positions=positions)  # (B, T, D)
    return jnp.einsum("btd,vd->btv", x, self.head_weight()).astype(jnp.float32)  # (B, T, V)

  def head_weight(self) -> Float[Array, "V D"]:
    """The output projection in the compute dtype: the token embedding (tied) or the head's kernel, transposed."""
    w = self.wte.embedding[...] if self.head is None else self.head.kernel[...].T  # (V, D)
    return w.astype(jnp.dtype(self.cfg.dtype))

  def hidden(self, tokens: Int[Array, "B T"], rngs: nnx.Rngs | None = None, *, decode: bool = False,
             lengths: Int[Array, "B"] | None = None, last_only: bool = False,
             segment_ids: Int[Array, "B T"] | None = None,
             positions: Int[Array, "B T"] | None = None) -> Float[Array, "B T D"]:
    """The final LayerNorm's output in the compute dtype, which the output projection turns into logits;
    `rngs` (with a 'dropout' stream) turns dropout on, None is deterministic.

    segment_ids: packed documents, int (B, T): a token attends only earlier tokens with its own
    id (0 = padding, attends nothing). positions: int (B, T) indices into the position table
    (default 0..T-1; restart them at each document with segment_ids).
    decode=True: `tokens` continue each row's cached sequence (init_cache first). Token t of
    row b sits at position cache_index[b] + t; `lengths` (B,) says how many of the T are real
    (right padding; default all), and the caches advance by that much. last_only: (B, 1, D) at
    each row's last real token only (a prefill needs no others' logits; saves (B, T, V)).
    """
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be (B, T) ids, one row per sequence; got shape {tuple(tokens.shape)}")
    B, T = tokens.shape
    if lengths is not None and not decode:
      raise ValueError("lengths= applies with decode=True only (tokens appended to a KV cache)")
    if decode and (segment_ids is not None or positions is not None):
      raise ValueError("segment_ids= and positions= apply without decode: the KV cache keeps one document per "
                       "row and places tokens itself (decode each document in its own row)")
    if not decode and T > self.cfg.seq_len:
      raise ValueError(f"sequence of {T} tokens is longer than the model's seq_len ({self.cfg.seq_len})")
    for name, ids in (("segment_ids", segment_ids), ("positions", positions)):
      if ids is not None and (tuple(ids.shape) != (B, T) or not jnp.issubdtype(ids.dtype, jnp.integer)):
        raise ValueError(f"{name} must be an int array of the tokens' shape (B, T) = {(B, T)}; "
                         f"got {ids.dtype} of shape {tuple(ids.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be integer ids (B, T); got {tokens.dtype}")
    if not isinstance(tokens, jax.core.Tracer) and tokens.size:  # known: check (the embedding lookup would read
      ids = np.asarray(tokens)  # id -1 as the last row and give NaN past the table); numpy's own min, also in a jit
      if decode and lengths is not None and not isinstance(lengths, jax.core.Tracer):  # right padding is never read
        ids = ids[np.arange(T)[None, :] < np.asarray(lengths)[:, None]]
      lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
      if lo < 0 or hi >= self.cfg.vocab_size:
        raise ValueError(f"tokens must be ids in [0, vocab_size={self.cfg.vocab_size}); got values in [{lo}, {hi}]"
                         + (" among each row's first lengths tokens" if decode and lengths is not None else ""))
    if positions is not None and not isinstance(positions, jax.core.Tracer):  # known: check (traced: unchecked)
      lo, hi = int(np.asarray(positions).min()), int(np.asarray(positions).max())  # numpy's min, also in a jit
      if lo < 0 or hi >= self.cfg.seq_len:
        raise ValueError(f"positions must lie in [0, seq_len={self.cfg.seq_len}); got values in [{lo}, {hi}]")
    if decode:
      pos = self._decode_positions(B, T, lengths)  # (B, T)
    else:
      pos = jnp.arange(T)[None] if positions is None else positions  # (1 | B, T)
    dt = jnp.dtype(self.cfg.dtype)
    x = (self.wte(tokens) + self.wpe(pos)).astype(dt)  # (B, T, D)
    x = self.drop(x, deterministic=rngs is None, rngs=rngs)
    y = None  # the residual stream is x + y (models.ops.layernorm adds them)
    for block in self.blocks:
      x, y = block(_placed(x), _placed(y), rngs, decode=decode, lengths=lengths, segment_ids=segment_ids)
    if last_only:
      last = (jnp.full((B,), T) if lengths is None else jnp.asarray(lengths)) - 1  # (B,)
      take = lambda a: None if a is None else jnp.take_along_axis(a, jnp.maximum(last, 0)[:, None, None], axis=1)
      x, y = take(x), take(y)  # (B, 1, D)
    return residual_norm(self.ln_f, x, y, kernel=self.cfg.kernels)[1]  # (B, T, D) ln_f(x + y)

  def _decode_positions(self, B: int, T: int, lengths) -> Int[Array, "B T"]:
    """Each token's position: its row's cache_index + t; padding tokens (t >= lengths) get 0."""
    attn = self.blocks[0].attn
    if getattr(attn, "cache_index", None) is None:
      raise ValueError("decode=True needs a KV cache: call model.init_cache(batch, max_length) first")
    start = attn.cache_index[...]  # (B,)
    if start.ndim != 1:  # a scalar: one position for the whole batch, the layout Flax's own attention layers make
      what = "a scalar, one position for every row (as Flax's own attention layer keeps it)" if start.ndim == 0 \
          else f"of shape {tuple(start.shape)}"
      raise ValueError(f"the KV cache's cache_index is {what}; the model needs one position per row, shape (B,) = "
                       f"({B},): make the cache with model.init_cache(batch, max_length)")
    if start.shape != (B,):
      raise ValueError(f"the cache holds {start.shape[0]} rows (init_cache(batch=...)), tokens have {B}")
    t = jnp.arange(T)[None]  # (1, T)
    real = jnp.full((B,), T) if lengths is None else jnp.asarray(lengths)
    if not any(isinstance(a, jax.core.Tracer) for a in (start, real)):  # known: check (under jit the rows go NaN)
      end = np.asarray(start) + np.asarray(real)  # (B,) one past each row's last real position
      b = int(np.argmax(end))
      if end[b] > self.cfg.seq_len:
        raise ValueError(f"row {b} would reach position {int(end[b]) - 1}: past the model's context "
                         f"(seq_len {self.cfg.seq_len}, positions 0..{self.cfg.seq_len - 1})")
    return jnp.where(t < real[:, None], start[:, None] + t, 0)  # (B, T)


def count_params(model: GPT) -> int:
  """The N of MFU: weights that multiply activations (as nanochat counts them). Every kernel
  of the attention and MLP projections, and the token embedding where it is the tied output
  projection; not the position table or an untied token table (lookups, no FLOPs), nor
  biases and LayerNorm scales (elementwise)."""
  params = nnx.to_pure_dict(nnx.state(model.blocks, nnx.Param))
  kernels = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params) if path[-1].key == "kernel")
  head = model.wte.embedding.size if model.head is None else model.head.kernel.size
  return kernels + head


def flops_per_token(cfg: GPTConfig, n_params: int, seq_len: int) -> float:
  """Training FLOPs per token as nanoGPT / PaLM (appendix B) count them for MFU: 6N for the
  matmuls with weights (forward + backward) plus 12 * L * n_head * head_dim * T for attention
  scores and values. This counts the full T x T square, also for causal attention, whose
  kernels compute about half of it: MFU is that convention, not a count of what ran."""
  return 6 * n_params + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * seq_len
