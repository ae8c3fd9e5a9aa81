"""Former home of the kernel dispatcher, kept as an alias for one release: use models.ops (KERNELS, available,
resolve, triton_missing)."""

from models.ops import KERNELS, available, resolve, triton_missing

__all__ = ["KERNELS", "available", "resolve", "triton_missing"]
