"""The README's walk-through runs as written: its python blocks, in order, in one namespace.

Blocks marked `# needs an NVIDIA GPU` run only there (the whole walk-through runs on a GPU).
"""

import re
from pathlib import Path

import jax

README = Path(__file__).resolve().parents[1] / "README.md"


def walkthrough_blocks() -> list[str]:
  text = README.read_text()
  section = text[text.index("## From naive attention to FP8"):]
  section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_walkthrough_runs():
  blocks = walkthrough_blocks()
  assert len(blocks) >= 4
  namespace: dict = {}
  on_gpu = jax.default_backend() == "gpu"
  for block in blocks:
    if "needs an NVIDIA GPU" in block and not on_gpu:
      continue  # the GPU run of this test covers it
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README is ours
