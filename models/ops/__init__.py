"""The model's own fused ops and the one rule for which implementation of them runs.

The ops: the residual add and LayerNorm (models.ops.layernorm over the kernels models.ops.norm_fwd and
models.ops.norm_grad), the MLP's bias + GELU (models.ops.bias_gelu; without biases its forward is written for
the fc GEMM's cuBLASLt epilogue instead, models.ops.bias_gelu.gelu_of_gemm) and the loss's softmax gradient
(models.loss over models.ops.softmax_onepass, and models.ops.softmax_grad in float16). Their GPU kernels are
Pallas kernels for Pallas's Triton backend; models.ops.tiling holds what they share.

A `kernel` argument names one of KERNELS: "xla" (XLA's fusions of the same float32 formulas, any backend),
"pallas" (the kernels, compiled; a CUDA GPU only), "interpret" (the same kernels through the Pallas interpreter,
any backend, slow: for tests) or "auto". "auto" picks "pallas" where the kernels compile and the process has
one device, else "xla"; `resolve` says which and why. "pallas" where the kernels cannot compile is refused,
never replaced; asked for with several devices the LayerNorm and bias + GELU kernels run unsharded (each
device computes all of their work), while the loss's runs on each device's own tokens (models.loss splits
its chunk loop over a mesh's batch).

The kernels need Pallas's Triton backend (jax.experimental.pallas.triton), which jax deprecates. Where this jax
has none, every module here still imports, "auto" runs XLA's fusions and says why, and "pallas" and
"interpret" are refused with the reason.
"""

from __future__ import annotations

import importlib

import jax

from attnlayers import ArgumentError, device

KERNELS = ("auto", "xla", "pallas", "interpret")
TRITON = "jax.experimental.pallas.triton"  # Pallas's Triton backend, the one the kernels are written for


def triton_missing() -> str:
  """Why the kernels cannot be built by this jax ("" where they can): it has no Pallas Triton backend."""
  try:
    importlib.import_module(TRITON)
  except ImportError as e:
    return f"this jax ({jax.__version__}) has no Pallas Triton backend ({TRITON} does not import: {e})"
  return ""


def available(*arrays) -> tuple[bool, str]:
  """(True, "") where the Pallas kernels compile, else (False, why).

  Args:
    *arrays: the arrays the work reads; the kernels compile on the device they live on, or where none are given
      (or they are traced), where jit places traced work (attnlayers.device.of), if that is a CUDA GPU and this
      jax has Pallas's Triton backend.
  """
  if missing := triton_missing():
    return False, f"the Pallas kernels need Pallas's Triton backend, and {missing}"
  info = device.of(*arrays)
  if not info.is_cuda:
    return False, f"the Pallas kernels need a GPU (Pallas's Triton backend, CUDA); the device is {info.describe()}"
  return True, ""


def resolve(kernel: str = "auto", *arrays) -> tuple[str, str]:
  """(the kernel that `kernel` runs, why) for work on `arrays` (or where jit places work).

  Args:
    kernel: one of KERNELS.
    *arrays: as `available` takes them.

  Raises:
    ValueError: `kernel` is not in KERNELS.
    ArgumentError (a ValueError naming `kernel`): "pallas" where the kernels cannot compile; "interpret" where this jax
      has no Pallas Triton backend (the interpreter runs the same kernels, written with its loads and stores).
  """
  if kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
  ok, why = available(*arrays)
  if kernel == "auto":
    if ok and jax.device_count() > 1:  # a pallas_call has no sharding rule: each device would run all of it
      return "xla", (f"XLA fusions ({jax.device_count()} devices: the Pallas kernels have no sharding rule, and "
                     "XLA's fusions split the work over the devices)")
    return ("pallas", "one GPU: the Pallas kernels") if ok else ("xla", f"XLA fusions ({why})")
  missing = triton_missing()
  if kernel == "pallas" and not ok:
    interpret = "" if missing else ", 'interpret' (the same kernel interpreted, slow)"
    raise ArgumentError(f"kernel='pallas': {why}. Use kernel='xla' (XLA fusions, any backend){interpret} or 'auto'",
                        arguments=("kernel",), value=kernel, expected="'xla' or 'auto'" if missing else "'xla', 'interpret' or 'auto'")
  if kernel == "interpret" and missing:
    raise ArgumentError(f"kernel='interpret': the interpreter runs the Pallas kernels, written for Pallas's Triton "
                        f"backend, and {missing}. Use kernel='xla' (XLA fusions, any backend) or 'auto'",
                        arguments=("kernel",), value=kernel, expected="'xla' or 'auto'")
  return kernel, "as asked"
