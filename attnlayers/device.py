"""What the device running a call offers: platform, compute capability, cuDNN, TransformerEngine.

Backends decide whether they can run from these facts (never from GPU names), so
`explain()` can say exactly which requirement a machine misses. The device is the one the
arrays live on; for traced arrays (inside jit), which carry no device, it is the device jit
places uncommitted work on: the mesh in context, else jax's default device. A jitted call
whose inputs were committed elsewhere (jax.device_put(x, cpu) on a GPU machine) is not seen
from inside the trace: decide outside jit, or set jax.default_device for that work.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  platform: str  # device.platform: "cpu", "gpu" or "tpu"
  device_kind: str  # e.g. "NVIDIA H200"; for messages only
  compute_capability: tuple[int, int] | None  # CUDA devices only
  cudnn_version: int | None  # e.g. 91900 for 9.19.0; None where cuDNN is not loaded

  @property
  def is_cuda(self) -> bool:
    return self.platform == "gpu" and self.compute_capability is not None

  def describe(self) -> str:
    cc = f", compute capability {self.compute_capability[0]}.{self.compute_capability[1]}" if self.compute_capability else ""
    kind = "" if self.device_kind.lower() == self.platform else f" ({self.device_kind}{cc})"
    return f"{self.platform}{kind}"


def _compute_capability(device) -> tuple[int, int] | None:
  cc = getattr(device, "compute_capability", None)
  if not cc:
    return None
  major, minor = str(cc).split(".")[:2]
  return int(major), int(minor)


def _cudnn_version() -> int | None:
  try:  # jax exposes the loaded cuDNN's version only through this module
    from jax._src.lib import cuda_versions
  except ImportError:
    return None
  if cuda_versions is None:
    return None
  try:
    return int(cuda_versions.cudnn_get_version())
  except Exception:  # noqa: BLE001 - a missing or broken cuDNN means "no cuDNN"
    return None


@functools.cache
def info(device) -> DeviceInfo:
  """Facts about one jax device (cached per device)."""
  is_gpu = device.platform == "gpu"
  return DeviceInfo(
      platform=device.platform,
      device_kind=getattr(device, "device_kind", device.platform),
      compute_capability=_compute_capability(device) if is_gpu else None,
      cudnn_version=_cudnn_version() if is_gpu else None,
  )


def _placed_device(x):
  """The device a concrete array (or a ShapeDtypeStruct with a sharding) lives on, else None."""
  if isinstance(x, jax.core.Tracer):
    return None
  sharding = getattr(x, "sharding", None)
  devices = getattr(sharding, "device_set", None)
  return min(devices, key=lambda d: d.id) if devices else None


def _default_device():
  """Where jit places traced work: the mesh in context, else jax's default device."""
  try:  # the concrete mesh of `jax.set_mesh`; jax refuses the question inside jit
    mesh = jax.sharding.get_mesh()
  except (AttributeError, ValueError):
    mesh = None
  if mesh is not None and not getattr(mesh, "empty", True):
    return mesh.devices.flat[0]
  default = jax.config.jax_default_device
  if isinstance(default, str):
    return jax.devices(default)[0]
  return default if default is not None else jax.devices()[0]


def of(*arrays) -> DeviceInfo:
  """Facts about the device the arrays live on (the first placed one), or where jit puts traced work."""
  device = next((d for d in map(_placed_device, arrays) if d is not None), None)
  return info(device if device is not None else _default_device())


def current() -> DeviceInfo:
  """Facts about the device that work with no placed inputs would run on."""
  return info(_default_device())


@functools.cache
def has_module(name: str) -> bool:
  """True when `name` can be imported, without importing it."""
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False
