"""benchmarks.scaling_model's collective bytes against the compiler's: the training step compiled for 8 CPU devices on
three meshes (data=8, fsdp=8, fsdp=4 x tensor=2), its collectives read from the HLO (benchmarks.collectives)
beside what the model predicts for the same config, mesh and batch.

The step is train.step.build's. build makes the weights, so for gpt-1b's and gpt-7b's shapes the same step is
lowered from abstract arrays (jax.ShapeDtypeStruct with the trainer's shardings: compiled_step), nothing
allocated; rows() first checks that the two compile to the same collectives on the tiny preset. Fewer layers
than the preset's keep the compile short; the model is evaluated for the same layer count, so nothing is
scaled. XLA's CPU backend runs bfloat16 matmuls in float32, so activations the step moves are float32 here.
"""

from __future__ import annotations

import collections
import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx

import models
from attnlayers.fp8 import FP8Meta
from benchmarks import collectives, report, scaling_model
from train import mesh as train_mesh
from train import step as step_lib
from train.config import TrainConfig

DEVICES = 8
MESHES = ({"data": 8, "fsdp": 1, "tensor": 1}, {"data": 1, "fsdp": 8, "tensor": 1},
          {"data": 1, "fsdp": 4, "tensor": 2})
CONFIGS = (("tiny", None), ("gpt-1b", 2), ("gpt-7b", 2))  # preset, layers compiled (None: the preset's)
LARGEST = 3  # collectives listed per compiled step


def use_cpu_devices(n: int = DEVICES) -> None:
  """Run this process's jax on n CPU devices. XLA reads the flag when jax starts its backend, so this must come
  before anything asks jax for a device; raises where that has happened with another count."""
  flag = f"--xla_force_host_platform_device_count={n}"
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), flag]).strip()
  jax.config.update("jax_platforms", "cpu")
  if jax.device_count() != n:
    raise RuntimeError(f"benchmarks.scaling_check compiles for {n} CPU devices, and jax started with "
                       f"{jax.device_count()} before it could set {flag}: run it in a fresh process")


def trainer_step(cfg: models.GPTConfig, sizes: dict[str, int], rows: int) -> jax.stages.Compiled:
  """train.step.build's own step, compiled for a mesh of `sizes` with `rows` rows of cfg.seq_len per
  data-parallel rank. build makes the weights: for small configs only (compiled_step takes any size)."""
  mesh = train_mesh.make(sizes)
  model, state = step_lib.build(TrainConfig(model=cfg, batch_size=_batch(sizes, rows)), mesh)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  return model.train_step.lower(abstract, *_batch_args(cfg, sizes, rows, mesh)).compile()


def compiled_step(cfg: models.GPTConfig, sizes: dict[str, int], rows: int) -> jax.stages.Compiled:
  """trainer_step without any weights: train.step.jitted's step (the trainer's optimizer, shardings,
  out_shardings and mesh contexts) lowered from abstract arrays. rows() checks that the two compile to the same
  collectives on the tiny preset."""
  mesh = train_mesh.make(sizes)
  run = TrainConfig(model=cfg, batch_size=_batch(sizes, rows))
  graphdef, params, fp8 = nnx.split(nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param, FP8Meta)
  tx = step_lib.optimizer(run)
  state = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "fp8": fp8}
  shardings = train_mesh.state_shardings(state, tx, mesh, cfg)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  train_step, _ = step_lib.jitted(run, graphdef, tx, shardings, mesh)
  return train_step.lower(abstract, *_batch_args(cfg, sizes, rows, mesh)).compile()


def _batch(sizes: dict[str, int], rows: int) -> int:
  return rows * sizes["data"] * sizes["fsdp"]


def _batch_args(cfg: models.GPTConfig, sizes: dict[str, int], rows: int, mesh) -> tuple:
  """A step's (batch, step) arguments, abstract: inputs and targets (B, T) split over the batch's mesh axes."""
  token = jax.ShapeDtypeStruct((_batch(sizes, rows), cfg.seq_len), jnp.int32, sharding=train_mesh.batch_sharding(mesh))
  return {"inputs": token, "targets": token}, jax.ShapeDtypeStruct((), jnp.int32)


def compare(name: str, layers: int | None, sizes: dict[str, int], rows: int = 1) -> tuple[list[dict], list[dict],
                                                                                           dict]:
  """For one preset and mesh: a row per collective kind, the HLO's count and bytes beside the
  model's, and a row for reductions of either kind (XLA's CPU pipeline emits an all-reduce and a slice where a
  GPU's emits a reduce-scatter); the LARGEST collectives of the HLO by bytes, alike ones (kind, array,
  jax operation) together; and a row of memory: the compiled step's arguments per device (the state it
  donates and the batch's token ids; jit drops the unused step number) beside the model's parameters and
  optimizer state, and the temporary buffers XLA plans beyond them (gradients, activations, gathered weights;
  float32 on a CPU)."""
  cfg = models.preset(name) if layers is None else dataclasses.replace(models.preset(name), n_layer=layers)
  compiled = compiled_step(cfg, sizes, rows)
  found = collectives.parse(compiled.as_text())
  hlo = collectives.summarize(found)
  predicted = scaling_model.transfers(cfg, sizes, rows, regather=False)
  payload, count = scaling_model.per_kind(predicted), scaling_model.per_kind(predicted, lambda x: x.count)
  key = {"preset": name, "layers": cfg.n_layer, "mesh": scaling_model.describe(sizes)}
  row = lambda kind, h_count, h, m_count, m: key | {
      "kind": kind, "hlo_count": h_count, "model_count": m_count, "hlo_bytes": h, "model_bytes": m,
      "ratio": round(h / m, 4) if m else None}
  out = [row(k, hlo[k]["count"], hlo[k]["payload"], count.get(k, 0), payload.get(k, 0))
         for k in collectives.KINDS if hlo[k]["count"] or payload.get(k)]
  if sizes["fsdp"] > 1:  # reduce-scatters as XLA's CPU pipeline emits them: all-reduces (and slices)
    both = ("all-reduce", "reduce-scatter")
    out.append(row("+".join(both), sum(hlo[k]["count"] for k in both), sum(hlo[k]["payload"] for k in both),
                   sum(count.get(k, 0) for k in both), sum(payload.get(k, 0) for k in both)))
  alike = collections.defaultdict(lambda: [0, 0])
  for c in found:
    entry = alike[c.kind, _array(c), _op(c.op)]
    entry[0] += c.runs
    entry[1] += c.payload * c.runs
  top = sorted(alike.items(), key=lambda kv: -kv[1][1])[:LARGEST]
  largest = [key | {"kind": k, "array": a, "op": op, "count": n, "bytes": b} for (k, a, op), (n, b) in top]
  held, model = compiled.memory_analysis(), scaling_model.memory(cfg, sizes, rows)
  state = model["params"] + model["optimizer"]
  memory = key | {"hlo_argument_bytes": held.argument_size_in_bytes, "model_state_bytes": state,
                  "ratio": round(held.argument_size_in_bytes / state, 6), "hlo_temp_bytes": held.temp_size_in_bytes}
  return out, largest, memory


def same_as_trainer(cfg: models.GPTConfig, sizes: dict[str, int], rows: int = 1) -> None:
  """Raises unless compiled_step's program has trainer_step's collectives, one by one (kind, arrays, runs)."""
  ours, theirs = (collectives.parse(f(cfg, sizes, rows).as_text()) for f in (compiled_step, trainer_step))
  key = lambda found: sorted((c.kind, c.arrays, c.runs) for c in found)
  if key(ours) != key(theirs):
    raise AssertionError(f"on --mesh {scaling_model.describe(sizes)} the abstract step compiles to other "
                         f"collectives than train.step.build's: {len(ours)} against {len(theirs)} (both are "
                         "train.step.jitted's step: the abstract state's shardings differ from build's)")


def _array(c: collectives.Collective) -> str:
  """The collective's largest array, and how many others it moves with it: 'f32[50304,2048] +35'."""
  name = max(c.arrays, key=lambda a: a[1])[0] if c.arrays else "?"
  return name + (f" +{len(c.arrays) - 1}" if len(c.arrays) > 1 else "")


def _op(op: str) -> str:
  """The jax operation a collective came from, less the step's name; 'combined' where XLA joined several."""
  op = op.removeprefix("jit(train_step)/")
  return f"{op.count(':') + 1} combined" if ":" in op else op


def rows() -> tuple[list[dict], list[dict], list[dict]]:
  """compare's rows (collectives, largest collectives, memory) for every config of CONFIGS on every mesh of
  MESHES, on DEVICES CPU devices, once compiled_step is seen to compile to trainer_step's collectives on the
  tiny preset."""
  use_cpu_devices()
  for sizes in MESHES:
    same_as_trainer(models.preset("tiny"), sizes)
  table, largest, memory = [], [], []
  for name, layers in CONFIGS:
    for sizes in MESHES:
      a, b, c = compare(name, layers, sizes)
      table += a
      largest += b
      memory.append(c)
  return table, largest, memory


COLS = ["preset", "layers", "mesh", "kind", "hlo_count", "model_count", "hlo_bytes", "model_bytes", "ratio"]
LARGEST_COLS = ["preset", "layers", "mesh", "kind", "array", "op", "count", "bytes"]
MEMORY_COLS = ["preset", "layers", "mesh", "hlo_argument_bytes", "model_state_bytes", "ratio", "hlo_temp_bytes"]


def markdown(table: list[dict], largest: list[dict], memory: list[dict]) -> str:
  return ("## The model against the compiled step: memory\n\n"
          "Per device: the step's arguments (the state it donates, AdamW's two int32 counts among it, and the "
          "batch's token ids) against the model's parameters and AdamW moments; hlo_temp_bytes: what XLA's CPU "
          "program holds beyond its arguments at its peak (gradients, activations in float32, gathered "
          "weights), not modelled here.\n\n"
          + report.markdown_table(memory, MEMORY_COLS)
          + "\n\n## The model against the compiled step: collectives\n\n"
          "8 CPU devices; bytes: each collective's whole array (an all-gather's result, an all-reduce's or "
          "reduce-scatter's operand) per device, summed over the step; model: benchmarks.scaling_model.transfers with "
          "regather=False (the step keeps each gathered weight for its backward).\n\n"
          + report.markdown_table(table, COLS)
          + f"\n\n## The {LARGEST} largest collectives of each compiled step\n\n"
          + report.markdown_table(largest, LARGEST_COLS))
