"""The collectives of a compiled program, read from its HLO text: how many of each kind and how many bytes.

benchmarks.scaling checks its per-step collective bytes against these. A collective's *payload* is the
whole array it acts on, as each device sees it: an all-gather's result, a reduce-scatter's operand, an
all-reduce's, all-to-all's or collective-permute's operand (the same size as its result). A ring moves
(n - 1) / n of the payload per device for an all-gather or reduce-scatter over n devices, twice that for
an all-reduce (benchmarks.scaling.wire_bytes).

Async pairs count once, at their -start (the -done carries no new data); a collective XLA combined with
others (one all-reduce of a tuple) counts once, with the bytes of all its arrays. A collective inside a
while loop's body counts once per iteration (the loop's known_trip_count, which compiled HLO records).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}  # HLO element type -> bytes (f8 types: 1, below)
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")  # f32[8,64], bf16[], f8e4m3fn[16]
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\(")  # name, result type, opcode
_NAME = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")  # a computation's first line
_CALLED = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|true_computation|false_computation)="
                     r"\{?(%[\w.\-]+(?:,\s*%[\w.\-]+)*)\}?")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str  # one of KINDS
  operand_bytes: int  # every operand array, as this device holds it
  result_bytes: int  # every result array (an async -start's results, not its operands echoed back)
  arrays: tuple[tuple[str, int], ...] = ()  # (type, bytes) of each array of the payload's side: ("f32[8,64]", 2048)
  op: str = ""  # the jax operation it came from (the HLO's metadata op_name), where the HLO says
  runs: int = 1  # times one execution of the module runs it: the trip counts of the loops around it

  @property
  def payload(self) -> int:
    """The whole array the collective acts on (module docstring): the larger of operand and result."""
    return max(self.operand_bytes, self.result_bytes)


def arrays(text: str) -> list[tuple[str, int]]:
  """(type, bytes) of each array type written in `text` ('f32[8,64]{1,0}' -> [('f32[8,64]', 2048)]), in
  order; tokens and other non-array types are skipped."""
  out = []
  for dtype, dims in ARRAY.findall(text):
    size = BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
    if size is None:
      raise ValueError(f"unknown HLO element type {dtype!r} in {text[:120]!r}; known: {', '.join(BYTES)}, f8*")
    out.append((f"{dtype}[{dims}]", size * math.prod(int(d) for d in dims.split(",") if d)))
  return out


def _operands(line: str, start: int) -> str:
  """The text between the '(' at `start` and its matching ')'."""
  depth = 0
  for i in range(start, len(line)):
    depth += {"(": 1, ")": -1}.get(line[i], 0)
    if depth == 0:
      return line[start + 1:i]
  raise ValueError(f"unbalanced parentheses in HLO line {line[:120]!r}")


def runs(hlo: str) -> tuple[dict[str, int], dict[str, str]]:
  """How many times one execution of the module runs each computation, and the computation each instruction
  lies in. Computations are printed before those that call them, ENTRY last; a while loop runs its body
  known_trip_count times (its condition once more). Raises for a loop without a known trip count."""
  where, calls, order, current = {}, collections.defaultdict(list), [], None
  for line in hlo.splitlines():
    if (c := _COMPUTATION.match(line)) and not line.startswith(" "):
      current = c.group(1)
      order.append(current)
    elif current and (m := _INSTR.match(line)):
      where[m.group(1)] = current
      trips = _TRIPS.search(line)
      for attr, names in _CALLED.findall(line):
        if attr in ("body", "condition") and trips is None:
          raise ValueError(f"a while loop without a known trip count: its collectives' runs per step are unknown: "
                           f"{line.strip()[:160]}")
        factor = int(trips.group(1)) + (attr == "condition") if attr in ("body", "condition") else 1
        calls[current] += [(name.strip().lstrip("%"), factor) for name in names.split(",")]
  times = collections.Counter({order[-1]: 1} if order else {})
  for name in reversed(order):
    for callee, factor in calls[name]:
      times[callee] += times[name] * factor
  return dict(times), where


def parse(hlo: str) -> list[Collective]:
  """Every collective instruction of an HLO module's text (compiled.as_text()), in order, each with the times
  one execution runs it. Operands are sized from their types where the text writes them inline, else from the
  instructions that define them."""
  lines = [(m, line) for line in hlo.splitlines() if (m := _INSTR.match(line))]
  types = {m.group(1): m.group(2) for m, _ in lines}  # instruction name -> result type
  times, where = runs(hlo)
  out = []
  for m, line in lines:
    opcode = m.group(3)
    kind = opcode.removesuffix("-start")
    if kind not in KINDS or opcode.endswith("-done"):
      continue
    text = _operands(line, m.end() - 1)
    operands = arrays(text) or [a for name in _NAME.findall(text) for a in arrays(types[name])]
    results = arrays(m.group(2))
    if opcode.endswith("-start") and len(results) > len(operands):  # a tuple that echoes the operands first
      results = results[len(operands):len(operands) * 2]
    ins, outs = sum(b for _, b in operands), sum(b for _, b in results)
    op = _OP_NAME.search(line)
    out.append(Collective(kind, ins, outs, tuple(results if outs >= ins else operands), op.group(1) if op else "",
                          times.get(where.get(m.group(1)), 1)))
  return out


def summarize(found: list[Collective]) -> dict[str, dict[str, int]]:
  """Per kind of KINDS: {count, operand_bytes, result_bytes, payload} summed over `found` (parse's), each
  collective as many times as it runs."""
  totals = {k: collections.Counter(count=0, operand_bytes=0, result_bytes=0, payload=0) for k in KINDS}
  for c in found:
    totals[c.kind].update(count=c.runs, operand_bytes=c.operand_bytes * c.runs, result_bytes=c.result_bytes * c.runs,
                          payload=c.payload * c.runs)
  return {k: dict(v) for k, v in totals.items()}
