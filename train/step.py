"""What a run trains with: the model split for training, AdamW, and the jitted step and evaluation functions.

train.loop runs them; benchmarks.steady and benchmarks.step time them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from attnlayers import fp8 as fp8_lib
from attnlayers.fp8 import FP8Meta
from models import compiler
from models.loss import head_cross_entropy
from train import mesh as mesh_lib
from train import optim
from train.config import TrainConfig

STEP_COMPILER_OPTIONS = compiler.GEMM  # the step's and evaluation's XLA options (models.compiler says why)



def batch_loss(graphdef, params, fp8, batch: dict, dropout_key):
  """Mean cross-entropy over every target of `batch` (Batches: no padding, none left out, packed or not),
  float32. The output layer and loss run fused in chunks (models.loss): the (B, T, V) logits never exist.
  The logits come out of their GEMM in the compute dtype, as the model's own logits do (GPT.__call__) and as
  nanoGPT's do under autocast; the softmax runs in float32. Its softmax - onehot runs on the kernel that
  the model's `kernels` setting resolves to (models.ops; the summary's "kernels")."""
  model = nnx.merge(graphdef, params, fp8)
  rngs = nnx.Rngs(dropout=dropout_key) if model.cfg.dropout else None
  h = model.hidden(batch["inputs"], rngs=rngs, segment_ids=batch.get("segment_ids"),
                   positions=batch.get("positions"))  # (B, T, D) compute dtype
  return head_cross_entropy(h, model.head_weight(), batch["targets"], logits_dtype=h.dtype, kernel=model.cfg.kernels)


@dataclasses.dataclass(frozen=True)
class Model:
  """The model split for training, the optimizer, and the jitted step functions."""
  graphdef: nnx.GraphDef  # the model's structure, without its state
  tx: optax.GradientTransformation  # AdamW with the run's schedule
  lr_at: optax.Schedule  # the learning rate of each update, by 0-based index (lr below reads it)
  lr_device: jax.Device | None  # where lr computes it: the host's CPU (None: the default device)
  n_params: int  # as nanoGPT counts them for FLOPs
  train_step: object  # (state, batch, step) -> (new state, loss); donates the old state; .lower(...) as jit's
  eval_loss: object  # (params, fp8, batch) -> loss, dropout off


def build(cfg: TrainConfig, mesh: jax.sharding.Mesh | NamedSharding) -> tuple[Model, dict]:
  """The model and optimizer, and the initial state {params, opt_state, fp8} laid out on `mesh` (train.mesh: each
  parameter and its optimizer moments as its logical axis names ask; a NamedSharding names its mesh too), each
  device making its own part of it (initializer)."""
  mesh = getattr(mesh, "mesh", mesh)
  tx = optimizer(cfg)
  init, graphdef, shardings = initializer(cfg, mesh, tx)
  params, fp8 = init()
  state = {"params": params, "opt_state": jax.jit(tx.init, out_shardings=shardings["opt_state"])(params),
           "fp8": fp8}
  train_step, eval_loss = jitted(cfg, graphdef, tx, shardings, mesh)
  lr_at = optim.schedule(cfg.lr, cfg.steps, cfg.warmup)
  n_params = models.count_params(nnx.merge(graphdef, params, fp8))
  return Model(graphdef, tx, lr_at, _host_cpu(), n_params, train_step, eval_loss), state


def initializer(cfg: TrainConfig, mesh: jax.sharding.Mesh | NamedSharding,
                tx: optax.GradientTransformation) -> tuple[object, nnx.GraphDef, dict]:
  """(init, graphdef, shardings): `init()` makes the model's (params, fp8) in place on `mesh`, jitted, each device
  only its own part (a model larger than one device's memory never exists whole), from the seed alone: jax's
  partitionable random bits give every mesh the same numbers. `shardings`: the whole state's layout
  (train.mesh.state_shardings), the moments of `tx` (optimizer) included. fp8: FP8 scaling state (te-fp8 only,
  else empty), replaced by its gradient each step, never optimised."""
  mesh = getattr(mesh, "mesh", mesh)
  make = lambda: nnx.split(models.GPT(cfg.model, rngs=nnx.Rngs(cfg.seed)), nnx.Param, FP8Meta)
  graphdef, params, fp8 = nnx.eval_shape(make)  # abstract: shapes, dtypes and logical axis names
  if fp8 and jax.device_count() > 1:
    raise ValueError(f"--attn te-fp8 trains on one device in this version (its amax reductions over the mesh are "
                     f"wired but not yet run on GPUs); have {jax.device_count()}")
  shardings = mesh_lib.state_shardings({"params": params, "opt_state": jax.eval_shape(tx.init, params), "fp8": fp8},
                                       tx, mesh, cfg.model)
  init = jax.jit(lambda: make()[1:], out_shardings=(shardings["params"], shardings["fp8"]))
  return init, graphdef, shardings


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW with the run's schedule, weight decay and clipping."""
  return optim.adamw(cfg.lr, cfg.steps, cfg.warmup, weight_decay=cfg.weight_decay, clip=cfg.clip)


def jitted(cfg: TrainConfig, graphdef: nnx.GraphDef, tx: optax.GradientTransformation, shardings: dict,
           mesh: jax.sharding.Mesh) -> tuple[_OnMesh, _OnMesh]:
  """The training step (state, batch, step) -> (new state, loss), donating the old state, and the evaluation
  (params, fp8, batch) -> loss, jitted for a state laid out as `shardings` (train.mesh.state_shardings) on `mesh`,
  each called and lowered inside the mesh's contexts (_OnMesh). Nothing here needs the state's values: lowering
  them from abstract arrays compiles the trainer's program without making any weights."""
  whole = NamedSharding(mesh, P())

  @functools.partial(jax.jit, donate_argnums=0, out_shardings=(shardings, whole),  # the state keeps its layout
                     compiler_options=STEP_COMPILER_OPTIONS)  # donated: new state in old buffers
  def train_step(state, batch, step):
    key = jax.random.fold_in(jax.random.key(cfg.seed), step)  # dropout depends on (seed, step) only
    loss, (grads, fp8) = jax.value_and_grad(lambda p, f: batch_loss(graphdef, p, f, batch, key), argnums=(0, 1))(
        state["params"], state["fp8"])  # the FP8Meta "gradient" is its updated value (attnlayers.fp8)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state, "fp8": fp8}, loss

  eval_loss = jax.jit(lambda params, fp8, batch: batch_loss(graphdef, params, fp8, batch, None),
                      out_shardings=whole, compiler_options=STEP_COMPILER_OPTIONS)
  on = functools.partial(_OnMesh, mesh, mesh_lib.rules(mesh, cfg.model))
  return on(train_step), on(eval_loss)


@dataclasses.dataclass(frozen=True)
class _OnMesh:
  """A jitted function called, and lowered, inside its mesh's contexts, where jit traces it: jax's mesh
  (jax.set_mesh), the logical axis rules that place the attention's heads (attnlayers.nnx) and the loss's
  tokens (models.loss), and TransformerEngine's mesh axes (te-fp8's amax reductions; attnlayers.fp8.mesh_axes).
  On one device none of them: the program is the one-device program it always was."""
  mesh: jax.sharding.Mesh
  rules: tuple  # train.mesh.rules of the model on the mesh
  fn: object  # the jitted function

  @contextlib.contextmanager
  def context(self):
    with contextlib.ExitStack() as stack:
      if self.mesh.size > 1:
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nnx.logical_axis_rules(self.rules))
        stack.enter_context(fp8_lib.mesh_axes(dp="data", fsdp="fsdp", tp="tensor"))
      yield

  def __call__(self, *args):
    with self.context():
      return self.fn(*args)

  def lower(self, *args):
    """jax's Lowered of the call (e.g. `.compile().as_text()`: the program each device runs, collectives included)."""
    with self.context():
      return self.fn.lower(*args)


def _host_cpu() -> jax.Device | None:
  """The host's CPU device, or None where JAX_PLATFORMS leaves out the CPU backend."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


def lr(model: Model, step: int) -> float:
  """The learning rate of step `step` (1-based), computed on the host's CPU device (model.lr_device): on the
  training device the computation would queue behind the step in flight, and a report reading it would wait
  for that step. (Without a CPU backend, on the default device.)"""
  with jax.default_device(model.lr_device):
    return float(model.lr_at(step - 1))
