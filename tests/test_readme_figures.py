"""Every figure the README's walk-through quotes is in a row of a result file its paragraph names, the row
its words describe (tests/figures.py says how a row is told from the others).

A paragraph that quotes a measured figure (a decimal number) must name at least one file of
benchmarks/results/h200 (e.g. `layer.md`). Figures are copied from those tables, never typed.
"""

import re
from pathlib import Path

import pytest

from tests import figures

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "h200"
FIGURE = figures.FIGURE


def walkthrough() -> str:
  text = (ROOT / "README.md").read_text()
  section = text[text.index("## From naive attention to FP8"):]
  section = section[:section.index("\n## ", 1)]
  return re.sub(r"```.*?```", "", section, flags=re.DOTALL)  # code is run by test_readme.py, not quoted


def result_files() -> dict[str, str]:
  return {str(p.relative_to(RESULTS)): p.read_text() for p in RESULTS.rglob("*.md")}  # e.g. packing/layer.md


def test_every_quoted_figure_is_in_a_named_file_in_the_row_its_words_describe():
  checked, failures = figures.check(walkthrough(), result_files())
  assert not failures, "\n\n".join(failures)
  assert checked >= 200, checked  # the walk-through quotes its numbers


LAYER = """
| section | backend | dtype | B | T | causal | pass | status | median_ms | vs_matmul |
|---|---|---|---|---|---|---|---|---|---|
| seq | cudnn | bfloat16 | 2 | 4096 | True | fwd | ok | 0.4919 | 0.4387 |
| seq | cudnn | bfloat16 | 2 | 4096 | True | fwd+bwd | ok | 1.484 | 0.4364 |
| seq | te | bfloat16 | 2 | 4096 | True | fwd | ok | 0.5748 | 0.3754 |
| seq | cudnn | bfloat16 | 2 | 16384 | True | fwd | ok | 4.09 | 0.8442 |
| seq | cudnn | bfloat16 | 2 | 16384 | False | fwd | ok | 7.626 | 0.9056 |
| batch | xla | bfloat16 | 16 | 4096 | True | fwd | ok | 23.59 | 0.4919 |
"""
TRAIN = """
| backend | bias | seq_len | status | tokens_per_s | vs_matmul | vs_cudnn |
|---|---|---|---|---|---|---|
| cudnn | with | 1024 | ok | 5.7e+05 | 0.7312 | 1 |
| cudnn | without | 1024 | ok | 5.9e+05 | 0.7569 | 1 |
| te-fp8 | with | 1024 | ok | 5.993e+05 | 0.7689 | 1.052 |
| te-fp8 | without | 1024 | ok | 6.071e+05 | 0.7788 | 1.029 |
"""


QUOTED = {  # id: (a paragraph, what its check says is wrong or None); every figure is somewhere in its file
    "its-row": ("At T=4096, causal, `cudnn` takes 0.4919 ms forward (`layer.md`).", None),
    "te-as-cudnn": ("At T=4096, causal, `cudnn` takes 0.5748 ms forward (`layer.md`).", "its backend is 'te'"),
    "fwd+bwd-as-fwd": ("At T=4096, causal, `cudnn` takes 1.484 ms forward (`layer.md`).", "its pass is 'fwd+bwd'"),
    "T16384-as-T4096": ("At T=4096, causal, `cudnn` takes 4.09 ms forward (`layer.md`).", "its T is '16384'"),
    "non-causal-as-causal": ("At T=16384 `cudnn` takes 7.626 ms forward, causal (`layer.md`).",
                             "its causal is 'non-causal'"),
    "B16-as-B2": ("At T=4096, B=2, `cudnn` takes 23.59 ms forward (`layer.md`).", "its B is '16'"),
    "no-row-named": ("It takes 0.4919 ms (`layer.md`).", "nothing around it names"),
    "right-row-wrong-column": ("At T=4096, causal, `cudnn` runs 0.4919 of matmul forward (`layer.md`).",
                               None),  # a limit: the column is not checked
    "with-without": ("`cudnn` trained at 5.9e+05 tokens/s without against 5.7e+05 with (`train.md`).", None),
    "without-as-with": ("`cudnn` trained at 5.9e+05 tokens/s with biases (`train.md`).", "its bias is 'without'"),
    "parenthesis": ("In one run `te-fp8` ran 1.052x (1.029x without biases, `train.md`).", None),
    "parenthesis-swapped": ("In one run `te-fp8` ran 1.029x (1.052x without biases, `train.md`).",
                            "its bias is 'with'"),
    "cudnn-as-te-fp8": ("`te-fp8` ran 0.7312 of its run's matmul (`train.md`).", "its backend is 'cudnn'"),
}


@pytest.mark.parametrize("paragraph, wrong", QUOTED.values(), ids=QUOTED.keys())
def test_a_figure_counts_only_in_the_row_its_words_describe(paragraph, wrong):
  """Every figure below is in the named file, so the check before this one (anywhere in the file) passed them all."""
  checked, failures = figures.check(paragraph, {"layer.md": LAYER, "train.md": TRAIN})
  assert checked == len(FIGURE.findall(paragraph))
  if wrong is None:
    assert not failures, failures
  else:
    assert len(failures) == 1 and wrong in failures[0], failures


def test_a_paragraph_that_quotes_a_figure_names_its_file():
  _, failures = figures.check("At T=4096 `cudnn` takes 0.4919 ms forward.", {"layer.md": LAYER})
  assert failures and "names no result file" in failures[0]


def test_a_labelled_figure_counts_where_its_label_shares_a_word_with_the_sentence():
  printed = "```\n  forward+backward:    60.76 ms\nstep (with AdamW):    65.13 ms\n```\n"
  assert not figures.check("The step took 65.13 ms (`step.md`).", {"step.md": printed})[1]
  assert figures.check("The step took 60.76 ms (`step.md`).", {"step.md": printed})[1]
