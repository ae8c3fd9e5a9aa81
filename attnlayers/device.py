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
import re

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


_ASKED = (re.compile(r"\((\d+)\s*B\)"), re.compile(r"(\d+)\s*bytes"),  # XLA's and its allocators' wordings
          re.compile(r"([\d.]+)\s*([KMGT])iB"))


def size(nbytes: float) -> str:
  """`nbytes` for a person: "512 B", "3.2 MiB", "1.16 TiB"."""
  for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= scale:
      return f"{nbytes / scale:.3g} {unit}"
  return f"{nbytes:.0f} B"


def _asked(message: str) -> float | None:
  """Bytes of the failed allocation, where XLA's message says."""
  for pattern in _ASKED:
    if m := pattern.search(message):
      return float(m.group(1)) * (2 ** (10 * "KMGT".index(m.group(2)) + 10) if m.lastindex == 2 else 1)
  return None


def host_memory(field: str = "MemAvailable") -> int | None:
  """Bytes of this machine's memory, as /proc/meminfo's `field` (MemAvailable: what a new allocation can have
  without swapping; MemTotal: all of it); None where there is no /proc/meminfo."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        name, value = line.split(":", 1)
        if name == field:
          return int(value.split()[0]) * 1024  # kB
  except (OSError, ValueError):
    pass
  return None


def out_of_memory(error: BaseException, device=None) -> str | None:
  """What ran out, in words, where `error` is JAX's report that an allocation failed (XLA's RESOURCE_EXHAUSTED) on
  `device` (default: where uncommitted work runs); None for any other error. Callers add which of their settings
  to lower.

  Returns e.g. "out of memory on gpu (NVIDIA H200, compute capability 9.0): 25 GiB asked, 140 GiB in all"."""
  message = str(error)
  if not isinstance(error, jax.errors.JaxRuntimeError) or "RESOURCE_EXHAUSTED" not in message or \
      not re.search(r"memory|allocat", message, re.I):
    return None
  device = _default_device() if device is None else device
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  limit = stats and stats.get("bytes_limit") or (host_memory("MemTotal") if device.platform == "cpu" else None)
  asked = _asked(message)
  what = f"{size(asked)} asked" if asked is not None else "XLA does not say how much was asked"
  return f"out of memory on {info(device).describe()}: {what}" + (f", {size(limit)} in all" if limit else "")


def xla_failure(error: BaseException, device=None) -> str | None:
  """JAX's report that XLA could not compile or run a program (a JaxRuntimeError) other than for memory
  (out_of_memory says that one) in one line, None for any other error: XLA's status and the first line of its
  message, e.g. "XLA failed on gpu (NVIDIA H200, compute capability 9.0): INTERNAL: cuDNN ...
  CUDNN_STATUS_NOT_SUPPORTED".
  Callers add what the program was and which of their settings to change."""
  if not isinstance(error, jax.errors.JaxRuntimeError):
    return None
  first = next((line.strip() for line in str(error).splitlines() if line.strip()), "no message")
  device = _default_device() if device is None else device
  return f"XLA failed on {info(device).describe()}: {first}"
