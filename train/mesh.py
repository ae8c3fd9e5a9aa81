"""The training mesh: `--mesh data=D,fsdp=F,tensor=T`, and where each array of the run lies on it.

jax's SPMD partitioner does the parallel work; this module only says where things lie. The model names
each parameter's axes (models.gpt: Flax's `out_sharding` metadata, logical names such as "embed" or
"heads"); RULES maps those names to the mesh's axes, as MaxText's logical_axis_rules do:

  data    the batch is split over it; every device of it holds the whole model (data parallelism)
  fsdp    the batch is split over it too, and every parameter's "embed" axis, and with the parameters
          the optimizer state, which takes their shardings (FSDP: each step gathers a layer's weights)
  tensor  attention heads, key/value heads, the MLP's hidden width and the vocabulary are split over it
          (tensor parallelism); key/value heads that `tensor` does not divide are held whole by every device

A sharded axis that the mesh axis does not divide is held whole (the rule table cannot split it evenly);
query heads that `tensor` does not divide are refused (check), as is a batch that data x fsdp does not.
"""

from __future__ import annotations

import math

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")  # the mesh's axes, in this order; each of size 1 where --mesh leaves it out
BATCH = ("data", "fsdp")  # the mesh axes the batch's rows are split over

# Logical axis name -> mesh axis (None: not split). Every name the model's parameters and activations carry.
RULES = (
    ("batch", BATCH),  # activations' rows
    ("length", None),  # activations' positions
    ("embed", "fsdp"),  # d_model
    ("vocab", "tensor"),  # token ids: the embedding's rows (and the tied output projection's)
    ("position", None),  # the position table's rows
    ("heads", "tensor"),  # query heads
    ("kv_heads", "tensor"),  # key/value heads; None where tensor does not divide them (rules)
    ("head_dim", None),
    ("mlp", "tensor"),  # the MLP's hidden width
    ("norm", None),  # LayerNorm scales and biases
)


class MeshError(ValueError):
  """A --mesh that cannot run: the message says what would."""


def parse(text: str | None, devices: int) -> dict[str, int]:
  """Each axis's size from `text`, "data=D,fsdp=F,tensor=T" (any subset, in any order; the rest 1); None or
  "": every one of `devices` on data. Raises MeshError for words it cannot read; sizes that do not fit the
  devices or the model are check's."""
  if not text:
    return {"data": devices, "fsdp": 1, "tensor": 1}
  sizes = {}
  for part in text.split(","):
    name, eq, value = part.strip().partition("=")
    if not eq or name not in AXES:
      raise MeshError(f"--mesh {text}: {part.strip()!r} is not AXIS=SIZE with AXIS one of {', '.join(AXES)}; e.g. "
                      f"--mesh fsdp={devices}")
    if name in sizes:
      raise MeshError(f"--mesh {text}: {name} is given twice; give each of {', '.join(AXES)} at most once")
    if not value.strip().isdigit() or int(value) < 1:
      raise MeshError(f"--mesh {text}: {name}={value} must be an int >= 1 (1: the axis is not used)")
    sizes[name] = int(value)
  return {a: sizes.get(a, 1) for a in AXES}


def describe(sizes: dict[str, int]) -> str:
  """"data=D,fsdp=F,tensor=T", as --mesh takes it."""
  return ",".join(f"{a}={sizes[a]}" for a in AXES)


def check(sizes: dict[str, int], devices: int, model, batch_size: int) -> str | None:
  """Why a mesh of `sizes` cannot train `model` (a models.GPTConfig) with `batch_size` rows on `devices`
  devices, with what would; None where it can."""
  n = math.prod(sizes.values())
  if n != devices:
    return (f"--mesh {describe(sizes)} spans {n} devices, and there are {devices}: the product of the sizes must be "
            f"{devices}, e.g. --mesh data={devices} or --mesh fsdp={devices}")
  t = sizes["tensor"]
  if model.n_head % t:
    fits = [d for d in range(1, model.n_head + 1) if model.n_head % d == 0 and devices % d == 0]
    return (f"--mesh tensor={t} splits the {model.n_head} query heads (n_head) {t} ways, which does not divide "
            f"them: give tensor one of {', '.join(map(str, fits))}, or another --n-head")
  rows = sizes["data"] * sizes["fsdp"]
  if batch_size % rows:
    return (f"--batch-size {batch_size} must be divisible by data x fsdp = {rows} (the mesh's rows; --mesh "
            f"{describe(sizes)}): give --batch-size {max(rows, batch_size // rows * rows)}, or another --mesh")
  return None


def notices(sizes: dict[str, int], model) -> list[str]:
  """What the run says about the mesh: key/value heads held whole where tensor does not divide them."""
  kv, t = model.n_kv_head or model.n_head, sizes["tensor"]
  if t > 1 and kv % t:
    return [f"--mesh tensor={t}: the {kv} key/value heads (n_kv_head) are not split {t} ways; every device of the "
            "tensor axis holds all of them, and the attention repeats them per query head (the query heads are "
            "split)"]
  return []


def make(sizes: dict[str, int], devices=None) -> jax.sharding.Mesh:
  """The mesh over `devices` (default: all), Auto axes: XLA's SPMD partitioner places the work (with jax
  0.11's default Explicit axes TransformerEngine's sharding rules refuse te-fp8's step)."""
  devices = jax.devices() if devices is None else devices
  return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def rules(mesh: jax.sharding.Mesh, model) -> tuple:
  """RULES for `model` on `mesh`: key/value heads not split where the tensor axis does not divide them."""
  if (model.n_kv_head or model.n_head) % mesh.shape["tensor"]:
    return tuple((name, None if name == "kv_heads" else axis) for name, axis in RULES)
  return RULES


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """A batch's (B, T) arrays: rows split over data x fsdp."""
  return NamedSharding(mesh, P(BATCH))


def _spec(names, shape, table: dict, mesh: jax.sharding.Mesh) -> P:
  """The PartitionSpec of an array of `shape` whose axes are named `names`, by `table`; an axis the mesh axis does
  not divide is not split."""
  unknown = [n for n in names if n not in table]
  if unknown:
    raise ValueError(f"logical axis names {unknown} have no rule in train.mesh.RULES (known: {', '.join(table)})")
  axes = []
  for name, size in zip(names, shape):
    axis = table[name]
    span = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis or ()))
    axes.append(axis if size % span == 0 else None)
  return P(*axes)


def shardings(tree, mesh: jax.sharding.Mesh, model):
  """Each array's NamedSharding in `tree` (an nnx.State of Variables, arrays or abstract ones), in a tree of the same
  structure (as nnx.get_named_sharding gives it): by its Variable's logical names (Flax's out_sharding metadata)
  and `rules`; held whole where it names none."""
  table = dict(rules(mesh, model))

  def one(v):
    if not isinstance(v, nnx.Variable):
      return NamedSharding(mesh, P())
    names = v.get_metadata().get("out_sharding")
    return v.replace(NamedSharding(mesh, _spec(names, v.shape, table, mesh) if names else P()))
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(state: dict, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, model) -> dict:
  """The shardings of a training state {params, opt_state, fp8} (arrays or abstract): the parameters' by their
  logical names, the optimizer's moments as their parameters', everything else (step counts, FP8 scaling state)
  whole on every device."""
  params = shardings(state["params"], mesh, model)
  whole = NamedSharding(mesh, P())
  opt = optax.tree_map_params(tx, lambda _, s: s, state["opt_state"], params,
                              transform_non_params=lambda _: whole, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return {"params": params, "opt_state": opt, "fp8": jax.tree.map(lambda _: whole, state["fp8"])}
