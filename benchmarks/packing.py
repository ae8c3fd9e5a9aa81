"""The segments and window sections of `python -m benchmarks.layer`: packed documents, sliding windows.

Training rows are packed with several documents, whose segment ids keep each document's
queries off the other documents' keys; long contexts are cut with a causal sliding window.
Both mask most of the causal triangle: a kernel that skips the masked blocks should get
faster, an unfused one (xla, naive) still computes the full square. So each row is timed
against a baseline of the same backend timed in the same run:

  segments  causal B2 T4096 N16 K16 H128 bf16, rows of D equal-length documents (T / D tokens
            each, ids 1 ... D; D = 1 is one id array of all 1s) for D = 1, 2, 4, 8, 16, and the
            unpacked call (no segment_ids at all; `segments` none). time_vs_unpacked = median_ms / the
            unpacked row's median_ms (same backend, dtype, level, pass). Target: D = 8 within
            10% of unpacked (time_vs_unpacked <= 1.10) on cudnn or te.
  window    window=(left, 0) with is_causal=True: query t attends keys t - left ... t. left 256,
            1024, 4096 and none (full causal) at T = 4096, 8192, 16384, B1 N16 K16 H128 bf16.
            vs_full = the full-causal row's median_ms / this row's (same backend, dtype, level,
            pass, T). Target: >= 4.5 at left 1024, T 16384, fwd+bwd, on the fastest fused backend.

FLOPs (benchmarks.flops.attention_segments, attention_window) count only the unmasked pairs.
`--quick`: the same sections with tiny shapes and fewer points (CPU).
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from benchmarks import report

SECTIONS = ("segments", "window")
FUSED = ("cudnn", "te", "te-fp8")  # the backends whose kernels can skip masked blocks
# The targets, checked against each run's rows by targets():
PACKED_TARGET = (8, 4096, 1.10)  # (documents, T, largest time_vs_unpacked) on any of PACKED_TARGET_BACKENDS
PACKED_TARGET_BACKENDS = ("cudnn", "te")
WINDOW_TARGET = (1024, 16384, 4.5)  # (left, T, smallest vs_full) fwd+bwd, on the fastest of FUSED
DOCUMENTS = (None, 1, 2, 4, 8, 16)  # documents per row; None: no segment ids (the baseline), 1: ids all 1
WINDOWS = (None, 256, 1024, 4096)  # left of window=(left, 0); None: full causal (the baseline)
WINDOW_SEQS = (4096, 8192, 16384)


def sweep(section: str, quick: bool) -> list[dict]:
  """The section's shapes, as benchmarks.layer.Case fields besides backend, dtype, pass and level.
  quick: tiny shapes and fewer points, each baseline kept (CPU)."""
  if section == "segments":
    shape = dict(B=2, T=64, N=4, K=4, H=32) if quick else dict(B=2, T=4096, N=16, K=16, H=128)
    return [shape | dict(causal=True, segments=d) for d in ((None, 1, 4) if quick else DOCUMENTS)]
  shape = dict(B=1, N=4, K=4, H=32) if quick else dict(B=1, N=16, K=16, H=128)
  seqs, windows = ((64, 128), (None, 16)) if quick else (WINDOW_SEQS, WINDOWS)
  return [shape | dict(T=T, causal=True, window=w) for T in seqs for w in windows]


def segment_ids(B: int, T: int, documents: int):
  """(B, T) int32: `documents` equal-length documents per row, ids 1 ... documents."""
  if documents < 1 or T % documents:
    raise ValueError(f"documents ({documents}) must be >= 1 and divide T ({T}): equal-length documents")
  row = jnp.repeat(jnp.arange(1, documents + 1, dtype=jnp.int32), T // documents)  # (T,)
  return jnp.broadcast_to(row, (B, T))  # (B, T)


def _key(r: dict) -> tuple:
  """What a row shares with its baseline: everything but its segments / window (the field named as its section)."""
  return tuple(r[k] for k in ("section", "backend", "dtype", "level", "pass", "B", "T", "N", "K", "H", "causal"))


def add_ratios(rows: list[dict]) -> list[dict]:
  """Sets time_vs_unpacked (segments: time / unpacked time) and vs_full (window: full-causal time / time) on
  every ok row whose baseline in `rows` (one run) is ok too; the baseline's own ratio is 1."""
  for section, column in (("segments", "time_vs_unpacked"), ("window", "vs_full")):
    sel = [r for r in rows if r["section"] == section and r["status"] == "ok"]
    base = {_key(r): r["median_ms"] for r in sel if r[section] is None}
    for r in sel:
      if _key(r) in base:
        b = base[_key(r)]
        r[column] = b / r["median_ms"] if section == "window" else r["median_ms"] / b
  return rows


def columns(section: str, cols: list[str]) -> list[str]:
  """The table's columns: the section's variable (segments / window) after `causal`, its ratio after `median_ms`."""
  ratio = {"segments": "time_vs_unpacked", "window": "vs_full"}[section]
  return [x for c in cols for x in ([c, section] if c == "causal" else [c, ratio] if c == "median_ms" else [c])]


def for_table(section: str, rows: list[dict]) -> list[dict]:
  """Rows as the table shows them: the baseline's None written out (segments none, window full)."""
  return [r | {section: {"segments": "none", "window": "full"}[section]} if r[section] is None else r for r in rows]


NOTES = {
    "segments": "Causal; `segments` D: each row holds D equal-length documents (T / D tokens, ids 1 ... D), "
                "passed as segment_ids; `none`: no segment_ids at all (the baseline). `time_vs_unpacked`: median_ms "
                "over the unpacked row's (same backend, dtype, level, pass, this run); below 1 is faster. FLOPs: "
                "D x causal attention of length T / D (benchmarks.flops.attention_segments).",
    "window": "Causal sliding window: `window` left means window=(left, 0) with is_causal=True, query t attends "
              "keys t - left ... t; `full`: plain causal (the baseline). `vs_full`: the full-causal row's "
              "median_ms over this row's (same backend, dtype, level, pass, T, this run); above 1 is faster. "
              "FLOPs: the in-window causal pairs only (benchmarks.flops.attention_window).",
}


def _status(rows: list[dict]) -> str:
  return ", ".join(f"{r['backend']} {r['pass']} {r['status']}" for r in rows)


def targets(section: str, rows: list[dict]) -> str:
  """The issue's target for the section (PACKED_TARGET / WINDOW_TARGET), against this run's rows."""
  lines = []
  if section == "segments":
    documents, T, most = PACKED_TARGET
    lines.append(f"Target: {documents} documents at T = {T} within {most - 1:.0%} of the unpacked call "
                 f"(time_vs_unpacked <= {most:.2f}) on {' or '.join(PACKED_TARGET_BACKENDS)}.")
    for r in rows:
      if r["segments"] == documents and r["T"] == T and r["backend"] in PACKED_TARGET_BACKENDS:
        lines.append(f"- {r['backend']} {r['level']} {r['pass']}: " + (
            f"{r['time_vs_unpacked']:.3g} ({'met' if r['time_vs_unpacked'] <= most else 'not met'})"
            if "time_vs_unpacked" in r
            else f"not measured ({r['status']})" if r["status"] != "ok" else "no ratio (its unpacked row did not run)"))
  else:
    left, T, least = WINDOW_TARGET
    lines.append(f"Target: window {left} at T = {T}, fwd+bwd, vs_full >= {least} on the fastest fused backend "
                 f"({', '.join(FUSED)}), for the attention core (the kernel must skip the blocks outside the window).")
    for level in dict.fromkeys(r["level"] for r in rows):
      sel = [r for r in rows if r["level"] == level and r["window"] == left and r["T"] == T
             and r["pass"] == "fwd+bwd" and r["backend"] in FUSED]
      timed = [r for r in sel if "vs_full" in r]
      if timed:
        best = min(timed, key=lambda r: r["median_ms"])
        verdict = ("met" if best["vs_full"] >= least else "not met") if level == "core" else \
            "for information: the projections take the same time with or without a window; the target is the core's"
        lines.append(f"- {level}: {best['backend']} ({best['median_ms']:.4g} ms) {best['vs_full']:.3g}x ({verdict})")
      elif sel:
        lines.append(f"- {level}: not measured ({_status(sel)})")
  if len(lines) == 1:
    lines.append("- not measured: this run has no such row")
  return "\n".join(lines)


def plots(out: str, rows: list[dict]) -> list[str]:
  """segments: time and time_vs_unpacked against documents per row; window: vs_full against the window, one plot
  per T. Core and layer, causal fwd+bwd. Returns the file names written."""
  names = []
  for level in ("core", "layer"):
    suffix = "" if level == "core" else f"_{level}"
    sel = [r for r in rows if r["section"] == "segments" and r["level"] == level and r["pass"] == "fwd+bwd"
           and r["segments"] is not None]
    for y in ("median_ms", "time_vs_unpacked") if sel else ():
      name = f"layer_segments{suffix}_{y}.png"
      report.line_plot(os.path.join(out, name), sel, x="segments", y=y,
                       title=f"segments ({level}), causal, fwd+bwd: {y} vs documents per row (T {sel[0]['T']})")
      names.append(name)
    win = [r for r in rows if r["section"] == "window" and r["level"] == level and r["pass"] == "fwd+bwd"
           and r["window"] is not None]
    for T in sorted({r["T"] for r in win}):
      name = f"layer_window{suffix}_T{T}_vs_full.png"
      report.line_plot(os.path.join(out, name), [r for r in win if r["T"] == T], x="window", y="vs_full",
                       title=f"window ({level}), causal, fwd+bwd, T {T}: speed-up over full causal vs left window")
      names.append(name)
  return names
