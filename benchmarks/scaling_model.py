"""The scaling model on paper: per-device memory and per-step collective bytes of training a GPT preset on a
mesh of data x fsdp x tensor devices (train.mesh), as functions of the config, the mesh and the batch.
benchmarks.scaling lays them out for DP, FSDP and FSDP+TP at 8, 64 and 512 devices; benchmarks.scaling_check
sets them beside the collectives XLA compiles for 8 CPU devices.

What the trainer keeps (train.step, train.optim): the parameters in param_dtype (float32 in every preset),
their gradients in the same dtype, and optax's AdamW state, two moments in the parameters' dtype; the
optimizer and gradients take the parameters' shardings. Activations are in the compute dtype (bfloat16).
Where a parameter lies is the trainer's own rule table (train.mesh): FSDP splits every "embed" axis over
`fsdp`; tensor parallelism splits query heads, key/value heads (where `tensor` divides them), the MLP's
hidden width and the vocabulary over `tensor`; an axis the mesh axis does not divide is held whole.

Letters: s sequence length, b rows per data-parallel rank, d d_model, a query heads, k key/value heads,
h head dim, r mlp_ratio, V vocabulary, L layers, t the tensor axis, n devices.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import models
from train import mesh as train_mesh

ROWS = 1  # b: sequences of the preset's seq_len per data-parallel rank (per device under DP and FSDP, per
#           tensor group under FSDP+TP), one micro-batch, no gradient accumulation


def describe(sizes: dict[str, int]) -> str:
  """The mesh as --mesh takes it, less its axes of size 1: "fsdp=4,tensor=2"."""
  return ",".join(f"{a}={sizes[a]}" for a in train_mesh.AXES if sizes[a] > 1) or "data=1"


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
  """A mesh of `sizes` without devices: enough to place arrays on paper, at any device count."""
  return AbstractMesh(tuple(sizes[a] for a in train_mesh.AXES), train_mesh.AXES,
                      axis_types=(AxisType.Auto,) * len(train_mesh.AXES))


@dataclasses.dataclass(frozen=True)
class Param:
  path: str  # e.g. "blocks/attn/query/kernel"
  shape: tuple[int, ...]  # the whole array
  local: tuple[int, ...]  # one device's shard of it
  copies: int  # how many the model holds: n_layer for a block's parameter, else 1
  names: tuple[str, ...]  # its axes' logical names (train.mesh.RULES)
  fsdp: bool  # whether it is split over the fsdp axis (FSDP gathers it; its gradient is reduce-scattered)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def local_size(self) -> int:
    return math.prod(self.local)


def parameters(cfg: models.GPTConfig, sizes: dict[str, int]) -> list[Param]:
  """Every parameter of the model, whole and as one device holds it on a mesh of `sizes`: the shapes of one
  block and the rest, from the model itself (nnx.eval_shape, nothing allocated); the shards by train.mesh's
  rules."""
  one = dataclasses.replace(cfg, n_layer=1, window=None, window_pattern=None)  # windows shape no parameter
  model = nnx.eval_shape(lambda: models.GPT(one, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  mesh = abstract_mesh(sizes)
  placed = train_mesh.shardings(state, mesh, cfg)
  out = []
  for (path, v), (_, s) in zip(nnx.to_flat_state(state), nnx.to_flat_state(placed)):
    sharding = s.get_value() if isinstance(s, nnx.Variable) else s
    spec = [a for axis in sharding.spec for a in ((axis,) if isinstance(axis, str) else axis or ())]
    name = "/".join(str(p) for p in path if not isinstance(p, int))
    out.append(Param(name, tuple(v.shape), tuple(sharding.shard_shape(v.shape)),
                     cfg.n_layer if path[0] == "blocks" else 1, tuple(v.get_metadata().get("out_sharding") or ()),
                     "fsdp" in spec and sizes["fsdp"] > 1))
  return out


def itemsize(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


def block_activations(cfg: models.GPTConfig, s: int, b: int, t: int) -> int:
  """Bytes one block keeps from its forward pass for its backward, per device, without recomputation.

  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4,
  equations 1 and 2) count s·b·d·(34 + 5·a·s/d) bytes per layer of 16-bit activations, 10 + 24/t of the 34
  under t-way tensor parallelism. Taken here term by term, for this model: no dropout (their 2·s·b·d of masks
  and a·s²·b of attention-dropout mask are absent), fused (flash) attention (their 5·a·s²·b of scores and
  softmax are never stored; the kernel keeps a float32 log-sum-exp per query and head instead), GQA's
  smaller K and V, and an MLP r·d wide. With c the compute dtype's bytes (2: 34·s·b·d is 17 such arrays;
  here 16 where a = k and r = 4, and t = 1):
    2·c·s·b·d       the two LayerNorms' inputs (the residual stream), held whole by every tensor rank
    2·c·s·b·d       the two LayerNorms' outputs (the q/k/v and fc GEMMs' input), held whole too
    c·s·b·d/t       Q
    2·c·s·b·h·k'    K and V, k' = k/t key/value heads per device (k where t does not divide k)
    c·s·b·d/t       the attention's output (the out projection's input)
    4·s·b·a/t       the attention's float32 log-sum-exp
    2·c·s·b·r·d/t   the GELU's input and output (the fc GEMM's output, the proj GEMM's input)
  """
  c, d, h = itemsize(cfg.dtype), cfg.d_model, cfg.head_dim
  k = cfg.n_kv_head or cfg.n_head
  k_local = k // t if k % t == 0 else k
  return (4 * c * s * b * d + 2 * c * s * b * d // t + 2 * c * s * b * h * k_local + 4 * s * b * cfg.n_head // t
          + 2 * c * s * b * cfg.mlp_ratio * d // t)


def head_activations(cfg: models.GPTConfig, s: int, b: int, t: int) -> int:
  """Bytes kept outside the blocks: the final LayerNorm's input (c·s·b·d) and the fused loss's saved
  gradients (models.loss.head_cross_entropy), dh (c·s·b·d) and dw, the output projection's (c·V·d/t: the
  vocabulary split over the tensor axis, where t divides it)."""
  c = itemsize(cfg.dtype)
  return 2 * c * s * b * cfg.d_model + c * cfg.vocab_size * cfg.d_model // (t if cfg.vocab_size % t == 0 else 1)


def memory(cfg: models.GPTConfig, sizes: dict[str, int], rows: int = ROWS) -> dict[str, int]:
  """Per-device bytes of one training step at its peak, by part:
    params       every parameter's shard, in param_dtype
    grads        their gradients, sharded alike, in param_dtype
    optimizer    AdamW's two moments, sharded alike, in param_dtype (the step counts are a few bytes)
    gathered     FSDP only: one block's gathered parameters, and the next one's in flight (2 blocks)
    activations  block_activations x L + head_activations, at `rows` rows of seq_len
  """
  ps, pb = parameters(cfg, sizes), itemsize(cfg.param_dtype)
  local = sum(p.local_size * p.copies for p in ps)
  block = sum(p.local_size * sizes["fsdp"] for p in ps if p.fsdp and p.path.startswith("blocks/"))
  gathered = 2 * block * pb
  s, t = cfg.seq_len, sizes["tensor"]
  acts = block_activations(cfg, s, rows, t) * cfg.n_layer + head_activations(cfg, s, rows, t)
  out = {"params": local * pb, "grads": local * pb, "optimizer": 2 * local * pb, "gathered": gathered,
         "activations": acts}
  return out | {"total": sum(out.values())}


@dataclasses.dataclass(frozen=True)
class Transfer:
  what: str  # what moves, e.g. "gather params (forward)"
  kind: str  # the collective: all-gather, reduce-scatter or all-reduce
  axis: str  # the mesh axis (or axes) it spans
  group: int  # devices in one group of that collective
  payload: int  # bytes per device per step: the whole array it acts on (benchmarks.collectives), summed
  count: int  # collectives per step, one per array (before XLA combines any)


def wire_bytes(x: Transfer) -> float:
  """Bytes each device sends (and receives) for `x` by a ring: (g-1)/g of the payload for an all-gather or
  reduce-scatter over g devices, 2·(g-1)/g for an all-reduce (a reduce-scatter, then an all-gather)."""
  share = (x.group - 1) / x.group
  return x.payload * share * (2 if x.kind == "all-reduce" else 1)


def transfers(cfg: models.GPTConfig, sizes: dict[str, int], rows: int = ROWS,
              regather: bool = True) -> list[Transfer]:
  """The collectives of one training step, per device:
    DP (data axis)        all-reduce every gradient: the whole model's P·p bytes (p = param_dtype's bytes)
    FSDP (fsdp axis)      all-gather every fsdp-split parameter for the forward, again for the backward
                          (regather: ZeRO-3 / PyTorch FSDP free a layer's weights after its forward;
                          False: the gathered weights stay live until the backward), and reduce-scatter its
                          gradient; parameters not split over fsdp (LayerNorms, q/k/v biases) all-reduce their
                          gradient over data and fsdp
    data x fsdp           with both > 1, the fsdp shards' gradients all-reduce over data too
    TP (tensor axis)      Megatron's all-reduces of the activations, 2 in the forward (after the attention's
                          and the MLP's row-parallel GEMM) and 2 in the backward (the gradients of their
                          column-parallel GEMMs' inputs) per block, c·b·s·d bytes each; with the vocabulary
                          split, the embedding's lookup all-reduces its rows' partial sums (in param_dtype) and
                          the loss's gradient of h (c·b·s·d) its partial sums; key/value kernels and biases
                          that tensor does not split all-reduce their gradients over it (each rank's query
                          heads give a part)
  Parameters are gathered and gradients reduced in param_dtype (float32), as the trainer holds them.
  """
  ps, p = parameters(cfg, sizes), itemsize(cfg.param_dtype)
  data, fsdp, t = sizes["data"], sizes["fsdp"], sizes["tensor"]
  split = [x for x in ps if x.fsdp]
  whole = [x for x in ps if not x.fsdp]
  out = []
  if split:
    gathered = sum(x.local_size * fsdp * x.copies for x in split) * p  # a tensor rank's part of each
    arrays = sum(x.copies for x in split)
    passes = ("forward", "backward") if regather else ("forward",)
    out += [Transfer(f"gather params ({w})", "all-gather", "fsdp", fsdp, gathered, arrays) for w in passes]
    out.append(Transfer("reduce-scatter grads", "reduce-scatter", "fsdp", fsdp, gathered, arrays))
    if data > 1:
      local = sum(x.local_size * x.copies for x in split) * p
      out.append(Transfer("all-reduce grad shards", "all-reduce", "data", data, local, arrays))
  if whole and data * fsdp > 1:
    local = sum(x.local_size * x.copies for x in whole) * p
    out.append(Transfer("all-reduce grads", "all-reduce", "data x fsdp", data * fsdp, local,
                        sum(x.copies for x in whole)))
  if t > 1:
    c, act = itemsize(cfg.dtype), rows * cfg.seq_len * cfg.d_model
    out.append(Transfer("block activations (Megatron)", "all-reduce", "tensor", t, 4 * cfg.n_layer * act * c,
                        4 * cfg.n_layer))
    if cfg.vocab_size % t == 0:
      out.append(Transfer("embedding lookup, loss's dh", "all-reduce", "tensor", t, act * (p + c), 2))
    kv = [x for x in ps if "kv_heads" in x.names and (cfg.n_kv_head or cfg.n_head) % t]
    if kv:  # held whole, each rank's query heads give part of their gradient
      out.append(Transfer("key/value grads (kv heads held whole)", "all-reduce", "tensor", t,
                          sum(x.local_size * x.copies for x in kv) * p, sum(x.copies for x in kv)))
  return out


def per_kind(xs: list[Transfer], value=lambda x: x.payload) -> dict[str, float]:
  """`value` of the transfers summed per collective kind."""
  out: dict[str, float] = {}
  for x in xs:
    out[x.kind] = out.get(x.kind, 0) + value(x)
  return out
