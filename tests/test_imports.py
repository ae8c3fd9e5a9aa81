"""Every module of the models, the trainer, the benchmarks and the GPU-only tests imports on any machine: a name
that moved (train.loop's STEP_COMPILER_OPTIONS went to train.step) broke the GPU tests' imports, which a CPU run
skips at run time but still collects, and a collection error stops the whole suite before any test runs."""

import glob
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".")
                 for pattern in ("models/*.py", "models/ops/*.py", "train/*.py", "benchmarks/*.py",
                                 "tests/test_gpu_*.py")
                 for p in glob.glob(os.path.join(ROOT, pattern)) if not p.endswith("__main__.py"))


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
  importlib.import_module(name)
