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
