"""The one registry of attention backends. Each backend is one module here with

  NAME: str, SUMMARY: str
  MIN_CC: (major, minor) compute capability it needs on an NVIDIA GPU, or None (no NVIDIA GPU needed)
  unmet(call: spec.Call) -> list[str]       every requirement this call misses ([] = can run)
  decide(call) -> a frozen decision         optional: how it runs a call it can run (mask form, layout,
                                            core); plan() makes it once and records it (default None)
  run(q, k, v, call, decision) -> (B, T, N, H), or (out, weights) when call.return_weights
  notes(call, decision) -> list[str]        optional: the decision in words (shown by explain)

`auto` is not a backend: it is the first of AUTO_ORDER whose `unmet` is empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from attnlayers.backends import cudnn, naive, splash, te, te_fp8, xla


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  summary: str
  min_cc: tuple[int, int] | None  # NVIDIA compute capability it needs; None: needs no NVIDIA GPU (unmet says where)
  unmet: Callable  # (Call) -> list[str]
  decide: Callable  # (Call) -> decision: how it runs a call it can run
  run: Callable  # (q, k, v, Call, decision) -> out
  notes: Callable  # (Call, decision) -> list[str]: the decision in words


def _no_decision(call) -> None:
  return None


def _no_notes(call, decision) -> list[str]:
  return []


REGISTRY: dict[str, Backend] = {
    m.NAME: Backend(m.NAME, m.SUMMARY, m.MIN_CC, m.unmet, getattr(m, "decide", _no_decision), m.run,
                    getattr(m, "notes", _no_notes))
    for m in (naive, xla, cudnn, te, te_fp8, splash)
}
AUTO = "auto"
# Fastest first. auto never changes the numerical contract: cudnn and splash only take half-precision
# inputs as they are, and only naive can return weights or apply dropout. cudnn runs only on an NVIDIA GPU
# and splash only on a TPU, so each platform's kernel comes first there (cudnn first: a GPU call it takes
# plans as before, with no TPU kernel's refusal listed).
AUTO_ORDER = ("cudnn", "splash", "xla", "naive")
NAMES: tuple[str, ...] = (AUTO, *REGISTRY)  # what a `backend=` field or --attn flag accepts


def check_name(name: str) -> str:
  if name not in NAMES:
    raise ValueError(f"unknown attention backend {name!r}; known backends: {', '.join(NAMES)}")
  return name


def get(name: str) -> Backend:
  check_name(name)
  if name == AUTO:
    raise ValueError("'auto' is a choice among backends, not a backend; resolve it with attnlayers.explain()")
  return REGISTRY[name]
