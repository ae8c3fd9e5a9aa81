import glob
import os
import signal

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# On CPU every test and every `python` a test starts share one compilation cache on disk: the same
# tiny models compile again and again across files, xdist workers and the trainer's subprocesses,
# and a cache hit costs a file read instead of an XLA compilation. JAX_COMPILATION_CACHE_DIR, if
# set, chooses the folder; by default it lies in the ignored .pytest_cache.
_CACHE = {"JAX_COMPILATION_CACHE_DIR": os.path.join(ROOT, ".pytest_cache", "jax-compilation"),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # cache every program, however quick to compile
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}  # and however small
if jax.default_backend() == "cpu":
  for _name, _value in _CACHE.items():
    os.environ.setdefault(_name, _value)  # the subprocesses of tests inherit these
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))

# A pytest started in the background by a non-interactive shell (`cmd &`) inherits SIGINT ignored, and so would
# every trainer it starts. The tests of Ctrl-C send SIGINT as a terminal does, to a process that takes it: give
# this process, and through it the subprocesses (exec resets a caught signal to its default), Python's handler.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)

if jax.default_backend() == "gpu":
  # The float32 tolerances in tests/reference.py assume IEEE float32 matmuls; XLA on NVIDIA
  # GPUs runs float32 dots as TF32 by default (errors ~1e-3), which would test the matmul
  # unit rather than the attention code. bfloat16 paths are unaffected.
  jax.config.update("jax_default_matmul_precision", "highest")


def _unused_nvidia_gpus() -> list[str]:
  """NVIDIA GPU device files on a machine where jax runs elsewhere, unless JAX_PLATFORMS chose that."""
  if jax.default_backend() == "gpu" or "JAX_PLATFORMS" in os.environ:
    return []
  return sorted(glob.glob("/dev/nvidia[0-9]*"))


def pytest_runtest_setup(item):
  """gpu tests skip where there is no NVIDIA GPU, and fail where one is present but jax cannot use it; tpu tests
  skip where jax runs on no TPU."""
  if "tpu" in item.keywords and jax.default_backend() != "tpu":
    pytest.skip(f"needs a TPU; jax's default backend here is {jax.default_backend()!r}")
  if "gpu" not in item.keywords or jax.default_backend() == "gpu":
    return
  unused = _unused_nvidia_gpus()
  if unused:  # a broken CUDA install must not pass as "no GPU here"
    pytest.fail(f"an NVIDIA GPU is present ({', '.join(unused)}) but jax runs on {jax.default_backend()!r}: "
                "install jax with CUDA (e.g. pip install 'jax[cuda13]'), or set JAX_PLATFORMS=cpu to run "
                "the CPU tests alone on purpose", pytrace=False)
  pytest.skip(f"needs an NVIDIA GPU; jax's default backend here is {jax.default_backend()!r}")
