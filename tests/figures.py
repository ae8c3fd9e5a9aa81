"""Which row of a result file a figure in the README or docs/ quotes.

The README and the pages of docs/ quote measured figures (decimal numbers) from the markdown files of
benchmarks/results, and a paragraph that quotes one names its files. Finding the figure *somewhere* in a named file proves
little: a four-digit figure of one row is often another row's too (`1.01` once matched an unrelated row).
So a figure counts only when a record of a named file holds it and fits the words around it.

A result file is read as records:
- a table row, known by its key: its cells left of the first column that holds a figure (backend, bias,
  T, causal, pass, ...; not `status`, an outcome, nor `section`, a sweep's name);
- any other figure (a `key: value` entry, a line of printed output, a sentence), known by its label:
  the words before it.

A table row fits when
- nothing contradicts it: for each key column whose cells differ between the rows of its file, if the
  text names values that column takes in some result file (`te`, `without`, `forward+backward`, `T=4096`),
  one of them is this row's. Sizes (T, B, N, K, H, step) count within the figure's clause (its part of
  the sentence between ';', ':' or ', and'); words count from the start of its paragraph, or of the list
  and its bullet, to the end of that clause, since "it" refers to a backend named before. A parenthesis
  that quotes other figures speaks of those, not of this one. Once a text names a backend, the one in its
  walk-through step's heading (`**3. ...** (`cudnn`, bf16)`) counts too: "against `xla`'s 119 ms";
- and something names it: a value of one of those columns appears in the paragraph, the paragraph
  before it or the step's heading (a file whose rows share one key needs none).
A labelled record fits when its label and the figure's sentence share a word.

What this cannot tell apart: rows named in the same sentence ("5.845e+05 with `te-fp8` against 5.597e+05
with `cudnn`" passes with the two figures swapped), rows that differ only where the text is silent, and
files: a figure may come from any file its paragraph names.
"""

from __future__ import annotations

import dataclasses
import re

FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?:e[+-]\d+)?(?!\.?\d)")  # 1.308x, 187.68GiB, 4.81e+05; not 0.11.2
WORD = re.compile(r"[a-z0-9]+(?:[+-][a-z0-9]+)*")  # te-fp8, fwd+bwd and non-causal are one word; fp8_core is two
CODE = re.compile(r"`([^`]*)`")
DEVICE = re.compile(r"\b(?:A100|H100|H200|B200)\b")  # not H=200
# the bias column's 'with' is 'with biases' or ends a phrase ('0.7144 with,'); any other 'with' is a preposition
PREPOSITION = re.compile(r"\bwith\b(?! biases\b|\s*[,.;:()]|\s*$)")
SAID_AS = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward+backward", "bfloat16": "bf16"}  # cell -> prose
SIZES = {"t": "T", "seq_len": "T", "b": "B", "batch": "B", "batch_size": "B", "n": "N", "k": "K", "h": "H",
         "step": "step"}  # a size column, or a size's name in the text -> the size
SIZE_SAID = re.compile(r"\b(t|b|n|k|h|batch|step)\s*=?\s*(\d+(?:\s*/\s*\d+)*)\b(?!\.\d)",  # T=4096, B2, K = 32 / 8
                       re.IGNORECASE)
NOT_KEY = {"status", "section"}  # an outcome, and a sweep's name (its rows are told apart by their sizes and modes)
STOP = {"the", "and", "for", "with", "from", "its", "this", "that", "than", "are", "was", "per", "each", "one", "all"}


@dataclasses.dataclass
class Record:
  where: str  # file:line
  figures: list[str]
  key: dict[str, str] | None = None  # a table row's key cells by column; None for a labelled figure
  varies: set[str] = dataclasses.field(default_factory=set)  # the key columns whose cells differ within its file
  cells: dict[str, str] = dataclasses.field(default_factory=dict)  # a table row's cells by column
  label: str = ""  # a labelled figure's text before it


@dataclasses.dataclass
class Quote:
  figure: str
  sentence: str  # the page's sentence that holds it
  clause: str  # the part of that sentence between ';', ':' or ', and' that holds it
  before: str  # its paragraph (or list lead and bullet) to the end of that clause, less parentheses quoting others
  around: str  # the step's heading, the paragraph before and its own
  heading: str  # the walk-through step's heading


def prose(text: str) -> str:
  """text less code, file names and GPU names (`benchmarks.layer`, `layer.md`, H200); a one-word name (`te`) stays."""
  return DEVICE.sub(" ", CODE.sub(lambda m: m.group(1) if re.fullmatch(r"[\w+-]+", m.group(1)) else " ", text))


def words(text: str) -> set[str]:
  return set(WORD.findall(FIGURE.sub(" ", PREPOSITION.sub(" ", prose(text).lower()))))


def sizes(text: str) -> dict[str, set[str]]:
  """The sizes text names: 'T=4096, B2' -> {'T': {'4096'}, 'B': {'2'}}."""
  said: dict[str, set[str]] = {}
  for name, values in SIZE_SAID.findall(prose(text)):
    said.setdefault(SIZES[name.lower()], set()).update(v.strip() for v in values.split("/"))
  return said


def cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def table_rows(name: str, header: list[str], rows: list[list[str]], first_line: int) -> list[Record]:
  holds = [any(FIGURE.search(r[i]) for r in rows if i < len(r)) for i in range(len(header))]
  width = holds.index(True) if True in holds else len(header)  # the key: the columns before the first figure
  out = []
  for i, row in enumerate(rows):
    key = {h: c for h, c in zip(header[:width], row) if c and h not in NOT_KEY}
    if key.get("causal") in ("True", "False"):
      key["causal"] = "causal" if key["causal"] == "True" else "non-causal"
    out.append(Record(f"{name}:{first_line + i}", FIGURE.findall(" | ".join(row)), key, cells=dict(zip(header, row))))
  return out


def records(name: str, text: str) -> list[Record]:
  """The records of one result file: its table rows, then its labelled figures."""
  out: list[Record] = []
  lines, prose_lines, fenced, i = text.splitlines(), [], False, 0

  def end_paragraph():  # a paragraph's sentences and bullets, each figure labelled by what precedes it there
    for item in re.split(r"(?:^|\n)- ", "\n".join(line for line, _ in prose_lines)):
      for sentence in re.split(r"(?<=[.;])\s+", item):
        out.extend(Record(f"{name}:{prose_lines[0][1]}", [m.group()], label=sentence[:m.start()])
                   for m in FIGURE.finditer(sentence))
    prose_lines.clear()

  while i < len(lines):
    line = lines[i]
    if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|-"):
      end = i + 2
      while end < len(lines) and lines[end].startswith("|"):
        end += 1
      out += table_rows(name, cells(line), [cells(row) for row in lines[i + 2:end]], i + 3)
      i = end
      continue
    if line.startswith("```") or line.lstrip().startswith("{") or not line.strip():
      end_paragraph()
    if line.startswith("```"):
      fenced = not fenced
    elif line.lstrip().startswith("{"):  # an environment or a summary: 'matmul_bf16_tflops': 656.3
      for m in re.finditer(r"""["'](\w+)["']:\s*([^,{}\]]+)""", line):
        out += [Record(f"{name}:{i + 1}", [f], label=m.group(1)) for f in FIGURE.findall(m.group(2))]
    elif fenced:  # printed output: 'step (with AdamW):    65.13 ms'
      out += [Record(f"{name}:{i + 1}", [m.group()], label=line[:m.start()]) for m in FIGURE.finditer(line)]
    elif line.strip():
      prose_lines.append((line, i + 1))
    i += 1
  end_paragraph()
  rows = [r for r in out if r.key is not None]
  for r in rows:  # what tells a row from the others of its file
    r.varies = {c for c in r.key if len({o.key.get(c) for o in rows}) > 1}
  return out


def vocabulary(all_records: list[Record]) -> dict[str, set[str]]:
  """Each word-valued key column's values over all files (backend -> {cudnn, te, ...}): what the text may name."""
  values: dict[str, set[str]] = {}
  for r in all_records:
    for column, cell in (r.key or {}).items():
      values.setdefault(column, set()).add(cell)
  return {column: cells for column, cells in values.items()
          if column.lower() not in SIZES and all(len(WORD.findall(c.lower())) == 1 and not c.isdigit() for c in cells)}


def says(cell: str, said: set[str]) -> bool:
  return cell.lower() in said or SAID_AS.get(cell) in said


def contradiction(row: Record, quote: Quote, vocab: dict[str, set[str]]) -> str | None:
  said, sized, topic = words(quote.before), sizes(quote.clause), words(quote.heading)
  for column in sorted(row.varies):
    cell = row.key[column]
    if column.lower() in SIZES:
      named = sized.get(SIZES[column.lower()], set())
    elif column in vocab:
      named = {v for v in vocab[column] if says(v, said)}
      named |= {v for v in vocab[column] if named and says(v, topic)}
    else:
      continue
    if named and cell not in named:
      return f"its {column} is {cell!r} where the text names {sorted(named)}"
  return None


def named(row: Record, quote: Quote) -> bool:
  said, sized = words(quote.around), sizes(quote.around)
  for column in row.varies:
    cell = row.key[column]
    if column.lower() in SIZES:
      if cell in sized.get(SIZES[column.lower()], ()):
        return True
    elif says(cell, said) or (len(WORD.findall(cell.lower())) > 1 and (words(cell) - STOP) & said):
      return True
  return not row.varies


def tie(quote: Quote, candidates: list[Record], vocab: dict[str, set[str]]) -> tuple[Record | None, list[str]]:
  """The record of candidates that quote quotes, or None; and why each other record holding its figure is not it."""
  why = []
  for r in (r for r in candidates if quote.figure in r.figures):
    if r.key is None:
      if (words(r.label) - STOP) & words(quote.sentence):
        return r, why
      why.append(f"{r.where}: its label {r.label[-60:].strip()!r} shares no word with the sentence")
    elif reason := contradiction(r, quote, vocab):
      why.append(f"{r.where}: {reason}")
    elif not named(r, quote):
      why.append(f"{r.where}: nothing around it names its { {c: r.key.get(c) for c in sorted(r.varies)} }")
    else:
      return r, why
  return None, why


def quotes(text: str, own: int, heading: str, around: str) -> list[Quote]:
  """The quotes of figures in text[own:] (text[:own] is a bullet list's lead, read with each bullet)."""
  out = []
  for m in FIGURE.finditer(text, own):
    start = max([0] + [b.end() for b in re.finditer(r"\.\s+|\n\s*- ", text[:m.start()])])
    stop = m.end() + re.search(r"\.(?:\s|$)|\n\s*- |$", text[m.end():]).start()
    before = text[:stop]
    while others := [p for p in re.finditer(r"\([^()]*\)", before)
                     if FIGURE.search(p.group()) and not p.start() < m.start() < p.end()]:
      before = before[:others[-1].start()] + " " * len(others[-1].group()) + before[others[-1].end():]
    clause = max([start] + [b.end() for b in re.finditer(r"[;:]\s+|, and ", before[:m.start()])])
    clause_end = m.end() + re.search(r"[;:]\s|, and |$", before[m.end():]).start()
    out.append(Quote(m.group(), before[start:], before[clause:clause_end], before[:clause_end], around, heading))
  return out


def units(paragraph: str) -> list[tuple[str, int]]:
  """The texts a paragraph's figures are read in, with where each one's own part starts: each row of a table
  (as 'header = cell, ...'), each bullet after the text that leads the list, or the whole paragraph."""
  lines = paragraph.strip().splitlines()
  if len(lines) > 1 and lines[0].startswith("|") and lines[1].startswith("|-"):
    header = cells(lines[0])
    return [(", ".join(f"{h} = {c}" for h, c in zip(header, cells(row))), 0) for row in lines[2:]]
  lead, *bullets = re.split(r"\n(?=- )", paragraph)
  return [(lead, 0)] + [(f"{lead}\n{b}", len(lead) + 1) for b in bullets]


def check(section: str, files: dict[str, str], unmeasured: frozenset[str] = frozenset()) -> tuple[int, list[str]]:
  """How many figures of section (a page's markdown, no code blocks) are tied to a record of the files (name ->
  text) their paragraph names, and what is wrong with each of the others. Figures in `unmeasured` (a version, a
  target, arithmetic on quoted figures) are not quotes: they are neither checked nor counted."""
  found = {name: records(name, text) for name, text in files.items()}
  vocab = vocabulary([r for rs in found.values() for r in rs])
  checked, failures, heading, previous = 0, [], "", ""
  for paragraph in (p for p in re.split(r"\n\s*\n", section) if p.strip()):
    if step := re.match(r"\*\*\d+\.[^*]*\*\*(?: \([^)]*\))?", paragraph):
      heading = step.group()
    names = [name for name in files if name in paragraph]
    quoted = [f for f in FIGURE.findall(paragraph) if f not in unmeasured]
    if quoted and not names:
      failures.append(f"this paragraph quotes {quoted} but names no result file:\n{paragraph}")
      continue
    for text, own in units(paragraph):
      for quote in quotes(text, own, heading, f"{heading}\n{previous}\n{paragraph}"):
        if quote.figure in unmeasured:
          continue
        record, why = tie(quote, [r for name in names for r in found[name]], vocab)
        checked += 1
        if record is None:
          failures.append(f"{quote.figure} in {quote.sentence.strip()!r}: no record of {names} fits"
                          + "".join(f"\n  {w}" for w in why))
    previous = paragraph
  return checked, failures
