"""Every figure the README's walk-through quotes is in the result file its paragraph names.

A paragraph that quotes a measured figure (a decimal number) must name at least one file of
benchmarks/results/h200 (e.g. `layer.md`), and each of its figures must appear, as written,
in one of the files it names. Figures are copied from those tables, never typed.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "h200"
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?:e[+-]\d+)?(?![\d.])")  # 1.308x and 187.68GiB count


def walkthrough_paragraphs() -> list[str]:
  text = (ROOT / "README.md").read_text()
  section = text[text.index("## From naive attention to FP8"):]
  section = section[:section.index("\n## ", 1)]
  section = re.sub(r"```.*?```", "", section, flags=re.S)  # code is run by test_readme.py, not quoted
  return [p for p in re.split(r"\n\s*\n", section) if p.strip()]


def test_every_quoted_figure_is_in_the_result_file_named_beside_it():
  files = {str(p.relative_to(RESULTS)): p.read_text() for p in RESULTS.rglob("*.md")}  # e.g. packing/layer.md
  checked = 0
  for paragraph in walkthrough_paragraphs():
    figures = FIGURE.findall(paragraph)
    if not figures:
      continue
    named = [name for name in files if name in paragraph]
    assert named, f"this paragraph quotes {figures} but names no file of {RESULTS}:\n{paragraph}"
    for figure in figures:
      assert any(re.search(rf"(?<![\w.]){re.escape(figure)}(?![\d.])", files[n]) for n in named), \
          f"{figure} is in none of {named}:\n{paragraph}"
      checked += 1
  assert checked >= 15, checked  # the walk-through quotes its numbers


def test_te_fp8_speed_note_quotes_the_result_files_it_names():
  """te-fp8's explain() note on where FP8 pays (attnlayers.backends.te_fp8.SPEED) is copied from results too."""
  import jax.numpy as jnp

  from attnlayers import spec
  from attnlayers.backends import te_fp8
  source = {"1.012": "gpt2-small/a2472b7-bias/train.md", "1.058": "gpt2-small/a2472b7-bias/train.md",
            "1.034": "gpt2-small/a2472b7-bias-repeat/train.md", "1.051": "gpt2-small/a2472b7-bias-repeat/train.md",
            "1.028": "gpt2-small/96cf60d-bias/train.md", "1.048": "gpt2-small/96cf60d-bias/train.md",
            "1.052": "gpt2-small/bias/train.md", "1.029": "gpt2-small/bias/train.md", "1.044": "gpt2-small/train.md", "1.037": "gpt2-small/steps300/train.md",
            "1.027": "gpt2-small/187a03c-train.md", "0.992": "gpt2-small/e29f464-train.md",
            "0.9893": "gpt2-small/03c8adb-train.md", "1.013": "gpt2-small/f626088-train.md",
            "1.091": "gpt2-medium/train.md", "1.128": "gpt2-medium/f626088-train.md",
            "1.277": "gpt-1b/train.md"}  # each figure of the note, and the file it is copied from
  assert all(n in open(te_fp8.__file__).read() for n in source.values())  # the module names its sources
  assert FIGURE.findall(te_fp8.SPEED) == list(source)
  for figure, name in source.items():
    assert re.search(rf"(?<![\w.]){re.escape(figure)}(?![\d.])", (RESULTS / name).read_text()), (figure, name)
  q = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
  call = spec.describe(q, q, q, spec.Options(scale=1.0, fp8_core="fp8-or-bf16"))
  assert te_fp8.notes(call)[-1] == te_fp8.SPEED
