"""Every figure the README and the pages of docs/ quote is in a row of a result file its paragraph names, the
row its words describe (tests/figures.py says how a row is told from the others).

A paragraph that quotes a measured figure (a decimal number) must name at least one file of
benchmarks/results/h200 (e.g. `layer.md`) or of another machine's folder there (e.g. `tpu-v5e/splash_blocks.md`). Figures are copied from those tables, never typed. The few
decimals that are not measurements (a version, a target, arithmetic on quoted figures) are listed in
UNMEASURED, page by page, with what each is.
"""

import re
from pathlib import Path

import pytest

from tests import figures

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "h200"
FIGURE = figures.FIGURE
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

REQUIREMENTS = {"8.0": "a compute capability", "8.9": "a compute capability", "9.1": "a cuDNN version",
                "9.10": "a cuDNN version"}  # the backend table's
UNMEASURED = {  # page: {figure: what it is}; each must be on its page, so the list cannot go stale
    "README.md": REQUIREMENTS,
    "docs/backends.md": {
        **REQUIREMENTS, "9.19": "a cuDNN version", "1.25": "a target speed-up", "1.05": "a target speed-up",
        "0.19": "arithmetic on quoted figures", "1.8": "arithmetic on quoted figures",
        "1.18": "arithmetic on quoted figures", "7.632": "arithmetic on quoted figures",
        "1.031": "arithmetic on quoted figures", "7.513": "arithmetic on quoted figures",
        "1.048": "arithmetic on quoted figures"},
    "docs/training.md": {"1.07": "the gpt-1b preset's parameter count, in billions"},
    "docs/walkthrough.md": {"0.8": "a sampling temperature, a setting of the counted program"},
}


def page(name: str) -> str:
  """A page's markdown less its code blocks: code is run by test_readme.py, not quoted."""
  return re.sub(r"```.*?```", "", (ROOT / name).read_text(), flags=re.DOTALL)


def result_files() -> dict[str, str]:
  """The H200's files by their path in RESULTS (e.g. packing/layer.md), the other machines' by their path in
  benchmarks/results (e.g. tpu-v5e/splash_blocks.md)."""
  others = {str(p.relative_to(RESULTS.parent)): p.read_text() for p in RESULTS.parent.glob("*/**/*.md")
            if RESULTS not in p.parents}
  return others | {str(p.relative_to(RESULTS)): p.read_text() for p in RESULTS.rglob("*.md")}


def test_the_docs_pages_are_all_checked():
  assert {"docs/walkthrough.md", "docs/backends.md", "docs/benchmarks.md"} <= set(PAGES), PAGES
  assert set(UNMEASURED) <= set(PAGES), set(UNMEASURED) - set(PAGES)


@pytest.mark.parametrize("name", PAGES)
def test_every_quoted_figure_is_in_a_named_file_in_the_row_its_words_describe(name):
  unmeasured = UNMEASURED.get(name, {})
  text = page(name)
  missing = [f for f in unmeasured if f not in FIGURE.findall(text)]
  assert not missing, f"{name} no longer holds {missing}: drop them from UNMEASURED"
  checked, failures = figures.check(text, result_files(), frozenset(unmeasured))
  assert not failures, "\n\n".join(failures)


def test_the_pages_quote_their_numbers():
  files = result_files()
  counts = {name: figures.check(page(name), files, frozenset(UNMEASURED.get(name, {})))[0] for name in PAGES}
  assert sum(counts.values()) >= 300, counts
  assert counts["docs/walkthrough.md"] >= 100 and counts["docs/benchmarks.md"] >= 100, counts


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
