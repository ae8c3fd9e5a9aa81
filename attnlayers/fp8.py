"""FP8 projections through TransformerEngine, and the state their scaling keeps.

`TEFp8DotGeneral` is one FP8 GEMM: the `dot_general` of a Flax Linear/LinearGeneral (the
output projection, an MLP GEMM), or called by attnlayers.nnx for the fused q/k/v
projection. It runs `transformer_engine.jax.dense.dense` under TE's `autocast` with a
recipe from `transformer_engine.common.recipe`. The kernel parameter stays an ordinary
nnx.Param of the same shape, so the parameter tree is the same for every backend.

Delayed scaling keeps, per GEMM operand (x, kernel, grad), a scale and an amax history in
`FP8Meta` variables: their own NNX variable type, so the optimizer (which takes nnx.Param)
never sees them; the FP8 attention core keeps one more (`core_history`, attnlayers.nnx's
`fp8_core`). TE updates them the JAX way: the gradient that `jax.grad` returns for an
FP8Meta *is* its new value (TE's custom VJP hands back the updated quantizers), so a training
step differentiates with respect to FP8Meta too and assigns the result; train/step.py does
(train/loop.py checkpoints the state with the parameters). Current scaling keeps no state.

Several devices: `mesh_axes(dp=..., fsdp=..., tp=...)` names the mesh axes (TE's MeshResource) for the
calls traced inside it; TE's GEMMs then reduce their amaxes over the whole mesh, so every device scales
with the same factors. Without it they run as on one device.

TransformerEngine is imported only inside calls, so this module imports without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import jax.numpy as jnp
from flax import nnx

from attnlayers import device as device_lib
from attnlayers import spec
from attnlayers.backends import te_fp8
from attnlayers.backends._reasons import is_default_precision
from attnlayers.plan import BackendUnavailableError

OPERANDS = ("x", "kernel", "grad")  # what TE quantises in one dense: input, weight, output gradient


class FP8Unavailable(BackendUnavailableError):
  """te-fp8's FP8 projections cannot run on this device; `reasons` names every one (te_fp8.requirements)."""

  def __init__(self, reasons: list[str]):
    super().__init__(te_fp8.NAME, tuple(reasons), "te-fp8 projections cannot run here:\n  - " + "\n  - ".join(reasons)
                     + "\nthe other backends run the same layer and parameters without FP8; "
                     "attnlayers.explain(backend, q, k, v) says which of them can run its attention here")


class FP8Meta(nnx.Variable):
  """FP8 scaling state (scale or amax history); replaced by its gradient, never optimised."""


@dataclasses.dataclass(frozen=True)
class FP8Recipe:
  """Which TE recipe scales the FP8 GEMMs; the defaults are TE's DelayedScaling as the codelab sets it."""
  # "delayed" (DelayedScaling: scales from an amax history) or "current" (Float8CurrentScaling); GEMMs and core alike
  kind: str = "delayed"
  core: str = "fp8"  # the attention core: "fp8" (or refuse), "fp8-or-bf16", "bf16"; see attnlayers.spec.FP8_CORE_MODES
  margin: int = 0  # delayed GEMMs: scale = 2^-margin * fp8_max / amax (the core: a power of two, no margin)
  amax_history_len: int = 1024  # delayed: steps of amax kept (GEMMs and core)
  amax_compute_algo: str = "max"  # delayed GEMMs: "max" of the history or "most_recent" (the core: always "max")

  def __post_init__(self):
    if self.kind not in ("delayed", "current"):
      raise ValueError(f"FP8Recipe.kind must be 'delayed' or 'current'; got {self.kind!r}")
    if self.core not in spec.FP8_CORE_MODES:
      raise ValueError(f"FP8Recipe.core must be one of {', '.join(map(repr, spec.FP8_CORE_MODES))}; got {self.core!r}")
    n = self.amax_history_len
    if not spec.is_integer(n) or n < 1:
      raise ValueError(f"FP8Recipe.amax_history_len must be an int >= 1, the steps of amax that delayed scaling "
                       f"keeps; got {n!r}")
    if self.amax_compute_algo not in ("max", "most_recent"):
      raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent' (what TE/JAX supports); got {self.amax_compute_algo!r}")

  def te_recipe(self):
    from transformer_engine.common import recipe  # lazy: TE only where FP8 runs
    if self.kind == "current":
      return recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID)
    return recipe.DelayedScaling(margin=self.margin, fp8_format=recipe.Format.HYBRID,
                                 amax_history_len=self.amax_history_len, amax_compute_algo=self.amax_compute_algo)


class TEFp8DotGeneral(nnx.Module):
  """A `dot_general` (for nnx.Linear / nnx.LinearGeneral) that runs as a TransformerEngine FP8 GEMM."""

  def __init__(self, recipe: FP8Recipe = FP8Recipe()):
    self.recipe = recipe
    if recipe.kind == "delayed":
      self.scale = nnx.data({n: FP8Meta(jnp.ones((1,), jnp.float32)) for n in OPERANDS})
      self.amax_history = nnx.data({n: FP8Meta(jnp.zeros((recipe.amax_history_len,), jnp.float32)) for n in OPERANDS})

  def _quantizer_set(self, te_recipe):
    from transformer_engine.jax.quantize import QuantizeMeta, QuantizeMetaSet, QuantizerFactory
    from transformer_engine.jax.quantize.helper import get_quantize_config_with_recipe
    if self.recipe.kind == "delayed":
      config = get_quantize_config_with_recipe(te_recipe)
      meta = {n: QuantizeMeta(margin=config.MARGIN, amax_compute_algo=config.AMAX_COMPUTE_ALGO,
                              scale=self.scale[n][...], amax_history=self.amax_history[n][...]) for n in OPERANDS}
    else:
      meta = {n: QuantizeMeta() for n in OPERANDS}
    return QuantizerFactory.create_set(fp8_recipe=te_recipe, quantize_meta_set=QuantizeMetaSet(**meta))

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_batch or rhs_batch:
      raise ValueError(f"FP8 projections take no batch dims in dot_general; got {dimension_numbers}")
    if not is_default_precision(precision):
      raise ValueError(f"FP8 projections quantise their operands to E4M3, so they cannot apply precision={precision}; "
                       "use backend='te' (bf16 GEMMs) for a matmul precision")
    if out_sharding is not None:
      raise ValueError("FP8 projections take no out_sharding; shard the inputs instead")
    if tuple(lhs_contract) != tuple(range(lhs.ndim - len(lhs_contract), lhs.ndim)) or \
        tuple(rhs_contract) != tuple(range(len(rhs_contract))):
      raise ValueError(f"FP8 projections contract the input's last dims with the kernel's first; got {dimension_numbers}")
    if reasons := te_fp8.requirements(device_lib.of(lhs, rhs)):
      raise FP8Unavailable(reasons)
    from transformer_engine.jax import autocast
    from transformer_engine.jax.dense import dense
    te_recipe = self.recipe.te_recipe()
    with autocast(enabled=True, recipe=te_recipe, mesh_resource=_mesh_resource()):
      return dense(lhs, rhs, None, contracting_dims=(tuple(lhs_contract), tuple(rhs_contract)),
                   quantizer_set=self._quantizer_set(te_recipe))


def _mesh_resource():
  """The MeshResource of the enclosing mesh_axes (TE's global one), or an empty one (one device): TE's autocast
  sets the one it is given for the calls inside it."""
  from transformer_engine.jax.sharding import MeshResource, global_mesh_resource
  try:
    return global_mesh_resource() or MeshResource()
  except AssertionError:  # newer TE: none set
    return MeshResource()


@contextlib.contextmanager
def mesh_axes(dp: str | None = None, fsdp: str | None = None, tp: str | None = None):
  """TE's MeshResource for the calls traced inside: the mesh axes the batch is split over (dp, fsdp; fsdp also
  splits the weights) and the heads (tp). TE's FP8 GEMMs and attention read it to place their collectives (amax
  reductions over every axis). A no-op where TransformerEngine is not installed."""
  if importlib.util.find_spec("transformer_engine") is None:
    yield
    return
  from transformer_engine.jax.sharding import MeshResource, global_shard_guard
  with global_shard_guard(MeshResource(dp_resource=dp, fsdp_resource=fsdp, tp_resource=tp)):
    yield


def core_history(recipe: FP8Recipe) -> FP8Meta:
  """The FP8 attention core's delayed-scaling state: amaxes of q, k, v (3, amax_history_len), zeros until a training
  step records some (attnlayers.backends._fp8_delayed: scales are powers of two from each row's max, 1 while it is zero).
  The recipe's margin and amax_compute_algo scale TE's GEMMs; the core always takes the row's max."""
  return FP8Meta(jnp.zeros((3, recipe.amax_history_len), jnp.float32))


def use_fp8_projections(layer, recipe: FP8Recipe) -> None:
  """Makes a Flax nnx attention layer's projections TE FP8 GEMMs: `fp8_qkv`, the state of one GEMM of the
  input with the q, k and v kernels side by side (attnlayers.nnx concatenates them each call), and `out`'s."""
  layer.fp8_qkv = nnx.data(TEFp8DotGeneral(recipe))  # data: its FP8Meta are state
  use_fp8_dense(layer.out, recipe)


def use_fp8_dense(linear: nnx.Linear | nnx.LinearGeneral, recipe: FP8Recipe) -> None:
  """Makes an nnx.Linear or LinearGeneral (an MLP GEMM, the output projection) run as a TE FP8 GEMM with its own scaling state; its parameters stay."""
  linear.dot_general = nnx.data(TEFp8DotGeneral(recipe))
