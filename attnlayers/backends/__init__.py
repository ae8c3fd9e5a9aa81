"""The one registry of attention backends. Each backend is one module here with

  NAME: str, SUMMARY: str
  MIN_CC: (major, minor) compute capability it needs on an NVIDIA GPU, or None (any device)
  unmet(call: spec.Call) -> list[str]       every requirement this call misses ([] = can run)
  run(q, k, v, opts: spec.Options) -> (B, T, N, H), or (out, weights) when opts.return_weights
  notes(call) -> list[str]                  optional: how a runnable call runs (shown by explain)

`auto` is not a backend: it is the first of AUTO_ORDER whose `unmet` is empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from attnlayers.backends import cudnn, naive, te, te_fp8, xla


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  summary: str
  min_cc: tuple[int, int] | None  # NVIDIA compute capability it needs; None: runs on any device
  unmet: Callable  # (Call) -> list[str]
  run: Callable  # (q, k, v, Options) -> out
  notes: Callable  # (Call) -> list[str]: how it runs a call it can run


def _no_notes(call) -> list[str]:
  return []


REGISTRY: dict[str, Backend] = {
    m.NAME: Backend(m.NAME, m.SUMMARY, m.MIN_CC, m.unmet, m.run, getattr(m, "notes", _no_notes))
    for m in (naive, xla, cudnn, te, te_fp8)
}
AUTO = "auto"
# Fastest first. auto never changes the numerical contract: cudnn only takes fp16/bf16
# inputs as they are, and only naive can return weights or apply dropout.
AUTO_ORDER = ("cudnn", "xla", "naive")
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
