"""The runnable claims of the README and docs/: the README's usage block and the walk-through's python blocks run
as written, and `python -m attnlayers` measures every backend against a float64 reference.

The walk-through's python blocks (docs/walkthrough.md) run in order, in one namespace. Blocks marked
`# needs an NVIDIA GPU` run only in the GPU test, which on other machines is reported as
skipped (with the reason) rather than passing without them.
"""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from attnlayers import __main__ as cli
from attnlayers import backends
from tests import reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WALKTHROUGH = ROOT / "docs" / "walkthrough.md"
GPU_ONLY = "needs an NVIDIA GPU"


def python_blocks(page: Path) -> list[str]:
  return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def walkthrough_blocks() -> list[str]:
  return python_blocks(WALKTHROUGH)


def run_blocks(blocks: list[str], page: Path = WALKTHROUGH) -> None:
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 - the page is ours


def test_the_readme_usage_block_runs():
  blocks = python_blocks(README)
  assert len(blocks) == 1 and "attnlayers.attention(" in blocks[0], "the README's usage block changed"
  run_blocks(blocks, README)


def test_walkthrough_runs_without_a_gpu():
  blocks = [b for b in walkthrough_blocks() if GPU_ONLY not in b]
  assert blocks, "no walk-through block runs without a GPU: did the section or its marker change?"
  run_blocks(blocks)


@pytest.mark.gpu
def test_walkthrough_runs_on_a_gpu():
  blocks = walkthrough_blocks()
  assert any(GPU_ONLY in b for b in blocks), f"no block marked {GPU_ONLY!r}: did the section change?"
  run_blocks(blocks)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cli_reference_is_the_tests_reference(causal):
  q, k, v = cli.inputs(2, 16, 4, 2, 16, "float32")  # GQA
  want, _ = reference.forward(np.asarray(q), np.asarray(k), np.asarray(v), is_causal=causal)
  np.testing.assert_allclose(cli.reference(q, k, v, causal), want, rtol=1e-12, atol=1e-12)


def test_cli_measures_every_backend_against_float64(capsys):
  shape = dict(batch=2, seq_len=16, heads=4, kv_heads=2, head_dim=16, dtype="float32")
  cli.main([f"--{k.replace('_', '-')}={v}" for k, v in shape.items()])
  header, *rows = capsys.readouterr().out.splitlines()
  assert "reference: float64" in header
  measured = dict(re.findall(r"^\s*(\S+)\s+ok.*max\|out - float64\| = (\S+)$", "\n".join(rows), flags=re.M))
  unavailable = re.findall(r"^\s*(\S+)\s+unavailable$", "\n".join(rows), flags=re.M)
  assert sorted([*measured, *unavailable]) == sorted(backends.NAMES)
  assert {"auto", "naive", "xla"} <= set(measured)  # these run on any machine
  q, k, v = cli.inputs(**shape)
  want, _ = reference.forward(np.asarray(q), np.asarray(k), np.asarray(v), is_causal=True)
  atol, rtol = reference.TOLERANCES[("float32", "out")]
  bound = atol + rtol * float(np.abs(want).max())
  for name, diff in measured.items():
    # > 0: a float32 kernel is never bit-exact against float64, so 0 would mean a self-comparison
    assert 0 < float(diff) <= bound, f"{name}: max|out - float64| = {diff}, allowed (0, {bound:.3g}]"


def test_the_layer_modules_are_reached_from_the_package_as_the_readme_writes_them():
  """`import attnlayers` then attnlayers.linen / .nnx / .fp8 (the README's Use section, docs/backends.md), in a fresh process."""
  import subprocess
  import sys
  code = ("import attnlayers; attnlayers.linen.MultiHeadDotProductAttention; attnlayers.nnx.MultiHeadAttention; "
          "attnlayers.fp8.FP8Unavailable\n"
          "try:\n  attnlayers.lnen\nexcept AttributeError as e:\n  print(e)")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                        cwd=README.parent)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "module 'attnlayers' has no attribute 'lnen'" in proc.stdout


def test_every_relative_link_of_the_readme_and_docs_names_a_file():
  pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
  broken = [f"{page.relative_to(ROOT)}: {target}" for page in pages
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
            if "://" not in target and not (page.parent / target).exists()]
  assert not broken, broken


def test_the_readme_is_a_front_page():
  """The README stays short (reference material lives in docs/) and keeps the two commands at the top."""
  text = README.read_text()
  assert len(text.splitlines()) <= 300 and len(text.encode()) <= 20_000, (len(text.splitlines()), len(text.encode()))
  first_block = text[text.index("```bash"):text.index("```", text.index("```bash") + 3)]
  assert "python -m train" in first_block and "python -m pytest" in first_block, first_block


def test_ci_runs_the_readmes_test_command():
  """.ci/run passes pytest the arguments of the README's test command (its first tier), so the command a new user
  runs is the one CI keeps green."""
  text = README.read_text()
  first_block = text[text.index("```bash"):text.index("```", text.index("```bash") + 3)]
  command = first_block[first_block.rindex("python -m pytest") + len("python -m pytest"):].splitlines()[0].strip()
  ci = (ROOT / ".ci" / "run").read_text()
  assert any(line.strip().startswith("tier ") and command in line for line in ci.splitlines()), (command, ci)
