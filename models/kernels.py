"""Which of the models' own GPU kernels a step runs: one rule for the loss's softmax gradient
(models.softmax_onepass; models.softmax_grad in float16), the residual add and LayerNorm
(models.norm_fwd, models.norm_grad) and the MLP's bias + GELU (models.bias_gelu), all Pallas
(Triton) kernels; without biases the GELU's forward is written for the fc GEMM's cuBLASLt epilogue
instead (models.bias_gelu.gelu_of_gemm), its backward still the Pallas kernel.

A `kernel` argument names one of KERNELS: "xla" (XLA's fusions, any backend), "pallas" (the kernel,
compiled; a CUDA GPU only), "interpret" (the same kernel through the Pallas interpreter, any backend,
slow: for tests) or "auto". "auto" picks "pallas" where it compiles and the process has one device,
else "xla"; `resolve` says which and why. "pallas" where it cannot compile is refused, never replaced;
asked for with several devices it runs, but unsharded: each device computes all of its work.
"""

from __future__ import annotations

import jax

from attnlayers import device
from attnlayers.spec import ArgumentError

KERNELS = ("auto", "xla", "pallas", "interpret")


def available(*arrays) -> tuple[bool, str]:
  """(True, "") where the Pallas kernels compile, else (False, why): on the device the arrays live on, or
  where jit places traced work (attnlayers.device.of), a CUDA GPU."""
  info = device.of(*arrays)
  if not info.is_cuda:
    return False, f"the Pallas kernels need a GPU (Pallas's Triton backend, CUDA); the device is {info.describe()}"
  return True, ""


def resolve(kernel: str = "auto", *arrays) -> tuple[str, str]:
  """(the kernel that `kernel` runs, why) for work on `arrays` (or where jit places work)."""
  if kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
  ok, why = available(*arrays)
  if kernel == "auto":
    if ok and jax.device_count() > 1:  # a pallas_call has no sharding rule: each device would run all of it
      return "xla", (f"XLA fusions ({jax.device_count()} devices: the Pallas kernels have no sharding rule, and "
                     "XLA's fusions split the work over the devices)")
    return ("pallas", "one GPU: the Pallas kernels") if ok else ("xla", f"XLA fusions ({why})")
  if kernel == "pallas" and not ok:
    raise ArgumentError(f"kernel='pallas': {why}. Use kernel='xla' (XLA fusions, any backend), 'interpret' (the "
                        "same kernel interpreted, slow) or 'auto'", arguments=("kernel",), value=kernel,
                        expected="'xla', 'interpret' or 'auto'")
  return kernel, "as asked"
