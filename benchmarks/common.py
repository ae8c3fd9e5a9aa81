"""The one timing helper for every benchmark, and the same-run matmul yardstick.

Compile first, warm up, then time each call to completion with jax.block_until_ready;
report the median with p10/p90. Absolute times drift between runs and machines, so
results are also given as a ratio to an 8192^3 bf16 matmul timed in the same process (on a
GPU; 512^3 elsewhere: yardstick_n) (benchmarks.train times it in its parent process, after the
training runs). FLOP counts
and their convention: benchmarks.flops.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
  median_ms: float
  p10_ms: float
  p90_ms: float
  calls: int


def reason(e: BaseException, width: int = 300) -> str:
  """A failed point's reason: the error's type and the first line of its message (its type alone where the
  message is empty), at most `width` characters of message."""
  first = next(iter(str(e).splitlines()), "")
  return f"{type(e).__name__}: {first[:width]}" if first else type(e).__name__


def refuse_unless_runnable(plans: dict, why: str) -> None:
  """Exits with code 2 and one line where a kernel a benchmark would time cannot run here.

  plans: {label: attnlayers.Plan or a list of them} (label: the kernel, with the flag or shape it comes from); every
  refused one is named with its reasons (labels with the same reasons share them; the library's `use backend=...`
  hints, which name Python arguments, are left out), then `why`: what the benchmark needs, where it runs. Called
  before any timing and before --out is made, so a machine that cannot run the benchmark costs nothing.
  """
  refused: dict[tuple[str, ...], list[str]] = {}
  for label, group in plans.items():
    reasons = dict.fromkeys(r.split(" (use backend=")[0] for p in (group if isinstance(group, list) else [group])
                            for rs in p.unmet.values() for r in rs)
    if reasons:
      refused.setdefault(tuple(reasons), []).append(label)
  if refused:
    said = ". ".join(f"{', '.join(labels)}: {'; '.join(reasons)}" for reasons, labels in refused.items())
    print(f"error: {said}. {why}", file=sys.stderr)
    sys.exit(2)


def check_out(parser, path: str, flag: str = "--out", file: bool = False) -> None:
  """Exits with code 2 and one line (parser.error) unless the folder `path` (`file`: the file `path`) can be
  written: a benchmark checks its output before it times anything, so rows are not timed and then lost. Makes
  nothing: it writes and deletes one temporary file in the nearest folder that exists (the check that holds for
  root and for read-only mounts alike, which permission bits do not say)."""
  if not path.strip():  # an unset variable: os.path.abspath('') is the working folder, written to unasked
    parser.error(f"{flag} {path!r} is an empty path (an unset variable?): leave out {flag} for its default, or give "
                 f"the {'file' if file else 'folder'} to write")
  folder = os.path.dirname(os.path.abspath(path)) if file else os.path.abspath(path)
  if file and os.path.isdir(path):
    parser.error(f"{flag} {path} is a folder; give the file to write")
  probe = folder
  while not os.path.lexists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    parser.error(f"{flag} {path} cannot be written: {probe} is a file, not a folder; give another {flag}")
  try:
    fd, tmp = tempfile.mkstemp(dir=probe, prefix=".write-check-")
    os.close(fd)
    os.remove(tmp)
  except OSError as e:
    parser.error(f"{flag} {path} cannot be written: {probe}: {e.strerror or e}; give another {flag}")


def time_fn(fn, *args, warmup: int = 3, calls: int = 20) -> Timing:
  jax.block_until_ready(fn(*args))  # compile
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(calls):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t) * 1e3)
  p10, p50, p90 = np.percentile(times, [10, 50, 90])
  return Timing(float(p50), float(p10), float(p90), calls)


def yardstick_n() -> int:
  """The yardstick matmul's default size: 8192 on a GPU or TPU; 512 elsewhere, where one call of ten chained 8192^3
  bf16 matmuls takes minutes (a CPU)."""
  return 8192 if jax.devices()[0].platform in ("gpu", "tpu") else 512


def matmul_tflops(n: int | None = None, dtype=jnp.bfloat16, calls: int = 20, chain: int = 10) -> float:
  """TFLOP/s of an n^3 matmul (default yardstick_n()) on random data, as this process measures it now.

  Each timed call runs `chain` dependent matmuls, so a call's launch and sync overhead is small beside its
  work and does not count against the rate.
  """
  n = yardstick_n() if n is None else n
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), dtype)
  b = jax.random.normal(kb, (n, n), dtype) / n**0.5  # keeps the chained products O(1)

  def chained(a, b):
    return jax.lax.fori_loop(0, chain, lambda _, x: x @ b, a)

  t = time_fn(jax.jit(chained), a, b, calls=calls)
  return chain * 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def environment() -> dict:
  import importlib.metadata

  import flax

  from attnlayers import device as device_lib
  dev = jax.devices()[0]
  try:
    te = importlib.metadata.version("transformer_engine")
  except importlib.metadata.PackageNotFoundError:
    te = None
  return {"jax": jax.__version__, "flax": flax.__version__, "python": platform.python_version(),
          "device": getattr(dev, "device_kind", dev.platform), "devices": jax.device_count(),
          "platform": dev.platform, "cudnn": device_lib.current().cudnn_version, "transformer_engine": te}


def forward_backward(f, args: tuple, data: tuple = ()):
  """(fn, args) timing f's forward and backward for every arg, with a random output cotangent.

  f is called as f(*args, *data); `data` are inputs it is not differentiated for (segment ids),
  passed in as arguments so that XLA cannot fold them into the program as constants.

  The program returns the forward output with the gradients, as a training step uses both:
  returning the gradients alone would let XLA delete every forward product the backward does
  not read (a linear layer's backward needs no forward output), so fewer FLOPs would run than
  benchmarks.flops counts. A loss like sum(f(x)) would hand back a cotangent of ones, with
  which XLA turns some backward matmuls into plain sums; a random cotangent (passed in, not
  baked into the program) keeps every backward product a real one.
  """
  out = jax.eval_shape(f, *args, *data)
  cotangent = jax.random.normal(jax.random.key(7), out.shape, jnp.float32).astype(out.dtype)
  n = len(args)

  def fwd_bwd(*a):  # a = (*args, *data, cotangent)
    out, pullback = jax.vjp(lambda *x: f(*x, *a[n:-1]), *a[:n])
    return out, pullback(a[-1])
  return fwd_bwd, (*args, *data, cotangent)


def dense_peak(kind: str = "bf16") -> tuple[float | None, str]:
  """(FLOP/s, name) of the device's datasheet dense peak for "bf16" or "fp8" programs (FP8 is twice
  bf16 on the tensor cores that have it); None where the device is not in train.metrics' table."""
  from train import metrics
  bf16 = metrics.peak_flops()
  if kind not in ("bf16", "fp8"):
    raise ValueError(f"peak kind must be 'bf16' or 'fp8'; got {kind!r}")
  return (bf16 and bf16 * (2 if kind == "fp8" else 1)), f"{kind}"
