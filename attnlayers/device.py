"""What the machine offers: platform, compute capability, cuDNN and TransformerEngine.

Backends decide whether they can run from these facts (never from GPU names), so
`explain()` can say exactly which requirement a machine misses.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  platform: str  # jax.default_backend(): "cpu", "gpu" or "tpu"
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
def current() -> DeviceInfo:
  """Facts about jax's default device, read once per process."""
  device = jax.devices()[0]
  platform = jax.default_backend()
  is_gpu = platform == "gpu"
  return DeviceInfo(
      platform=platform,
      device_kind=getattr(device, "device_kind", platform),
      compute_capability=_compute_capability(device) if is_gpu else None,
      cudnn_version=_cudnn_version() if is_gpu else None,
  )


@functools.cache
def has_module(name: str) -> bool:
  """True when `name` can be imported, without importing it."""
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False
