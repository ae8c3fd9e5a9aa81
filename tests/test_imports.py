"""Every module of the models, the trainer, the benchmarks and the GPU-only tests imports on any machine: a name
that moved (train.loop's STEP_COMPILER_OPTIONS went to train.step) broke the GPU tests' imports, which a CPU run
skips at run time but still collects, and a collection error stops the whole suite before any test runs."""

import glob
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = {os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__"): p  # module name -> file
         for pattern in ("models/*.py", "models/ops/*.py", "train/*.py", "benchmarks/*.py", "tests/test_gpu_*.py")
         for p in glob.glob(os.path.join(ROOT, pattern)) if not p.endswith("__main__.py")}
MODULES = sorted(FILES)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
  importlib.import_module(name)


def _imports(path: str, package: str) -> set[str]:
  """The modules of `package` (models, train) that the file at `path` imports, typing-only imports included."""
  import ast
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.split(".")[0] == package}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
      found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULE_FILES else node.module
                for a in node.names}
  return {m for m in found if m in MODULE_FILES}


MODULE_FILES = {name: path for name, path in FILES.items() if name.split(".")[0] in ("models", "train")}


@pytest.mark.parametrize("package", ["models", "train"])
def test_no_import_cycles(package):
  """No module of the models or the trainer imports, directly or through others, a module that imports it (a
  typing-only import counts: it is a cycle the reader follows all the same)."""
  graph = {name: _imports(path, package) for name, path in MODULE_FILES.items() if name.split(".")[0] == package}

  def cycle_from(name, path):
    for nxt in sorted(graph.get(name, ())):
      if nxt in path:
        return path[path.index(nxt):] + [nxt]
      if found := cycle_from(nxt, path + [nxt]):
        return found
    return None
  for name in graph:
    assert (cycle := cycle_from(name, [name])) is None, " -> ".join(cycle)
