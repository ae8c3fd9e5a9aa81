"""Throughput, MFU and the metrics file.

MFU = flops_per_token * tokens_per_s / peak, with flops_per_token from
models.flops_per_token (6N + 12 L n_head head_dim T) and peak the device's dense bf16
datasheet rate; null where the peak is unknown (CPUs, unlisted GPUs) unless --peak-tflops.
"""

from __future__ import annotations

import json

import jax

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s, by device_kind substring.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def peak_flops(override_tflops: float | None = None) -> float | None:
  if override_tflops:
    return override_tflops * 1e12
  device = jax.local_devices()[0]
  if device.platform != "gpu":
    return None
  kind = getattr(device, "device_kind", "")
  return next((v for k, v in PEAK_BF16.items() if k in kind), None)


def peak_memory_bytes() -> int | None:
  stats = jax.local_devices()[0].memory_stats() if hasattr(jax.local_devices()[0], "memory_stats") else None
  return (stats or {}).get("peak_bytes_in_use")


class MetricsFile:
  """Appends one JSON object a line; a resumed run keeps appending to the same file."""

  def __init__(self, path: str | None):
    self.file = open(path, "a", encoding="utf-8") if path and jax.process_index() == 0 else None

  def write(self, record: dict) -> None:
    if self.file:
      self.file.write(json.dumps(record) + "\n")
      self.file.flush()

  def close(self) -> None:
    if self.file:
      self.file.close()
