"""Every module of the models, the trainer, the sampler, the benchmarks and the GPU-only tests imports on any machine: a name
that moved (train.loop's STEP_COMPILER_OPTIONS went to train.step) broke the GPU tests' imports, which a CPU run
skips at run time but still collects, and a collection error stops the whole suite before any test runs.

Only the library is installed (pip install . puts attnlayers alone into site-packages); the app runs from the
checkout. The packages import downwards only, benchmarks and sample -> train -> models -> attnlayers, so the library stands
alone, and no app module imports itself back through others (an import cycle), at module level or in a function.
"""

import ast
import glob
import importlib
import os
import tomllib

import pytest
import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".")
                 for pattern in ("models/*.py", "models/ops/*.py", "train/*.py", "sample/*.py", "benchmarks/*.py",
                                 "tests/test_gpu_*.py")
                 for p in glob.glob(os.path.join(ROOT, pattern)) if not p.endswith("__main__.py"))
MAY_IMPORT = {  # each package and the packages of this project its modules may import
    "attnlayers": {"attnlayers"},
    "models": {"attnlayers", "models"},
    "train": {"attnlayers", "models", "train"},
    "sample": {"attnlayers", "models", "train", "sample"},
    "benchmarks": {"attnlayers", "models", "train", "benchmarks"},
}


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
  importlib.import_module(name)


def _sources() -> dict[str, str]:
  """Every module of the project's packages, by its dotted name (a package by its own), with its file."""
  found = {}
  for package in MAY_IMPORT:
    for path in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True):
      name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
      found[name.removesuffix(".__init__")] = path
  return found


def _imports(path: str, modules) -> set[str]:
  """The project's modules that the file at `path` imports anywhere in it (a function's imports included): `from
  train import data` is train.data, `from train.data import source` is train.data, `import models` is models."""
  found = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
  return {name for name in found if name.split(".")[0] in MAY_IMPORT}


GRAPH = {name: _imports(path, _sources()) - {name} for name, path in _sources().items()}


def test_no_package_imports_upwards():
  upward = sorted(f"{name} imports {target}" for name, targets in GRAPH.items() for target in targets
                  if target.split(".")[0] not in MAY_IMPORT[name.split(".")[0]])
  assert not upward, upward


def test_no_import_cycles_among_the_modules():
  """Depth-first search from every module; an edge back to a module on the current path closes a cycle."""
  cycles, done = [], set()

  def visit(name, path):
    for target in sorted(GRAPH.get(name, ())):
      if target in path:
        cycles.append(" -> ".join(path[path.index(target):] + [target]))
      elif target not in done:
        visit(target, path + [target])
    done.add(name)

  for name in sorted(GRAPH):
    visit(name, [name])
  assert not cycles, cycles


def test_only_the_library_is_installed():
  """The packages pyproject.toml's find rule gives setuptools are attnlayers's: models, train, sample and
  benchmarks would land in site-packages as top-level packages, where they collide with other projects'."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    rule = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
  installed = setuptools.find_packages(ROOT, **rule)
  assert "attnlayers" in installed and all(p.split(".")[0] == "attnlayers" for p in installed), installed
