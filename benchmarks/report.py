"""Writing benchmark results: JSON (rows + environment), CSV, a markdown report, PNG plots."""

from __future__ import annotations

import csv
import json
import sys

def require_plots() -> None:
  """Exits with code 2 and one line naming the extra unless matplotlib is installed. A benchmark that plots calls
  it once its flags parse (so --help works without the extra) and before it times anything."""
  try:
    _pyplot()
  except ModuleNotFoundError as e:
    if e.name != "matplotlib":  # one of matplotlib's own dependencies: its traceback says which
      raise
    print("error: the benchmarks write plots with matplotlib, which is not installed: pip install 'attnlayers[bench]'",
          file=sys.stderr)
    raise SystemExit(2) from None


def _pyplot():
  """matplotlib.pyplot writing files only (no display); imported on first use, an optional dependency."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  return "" if v is None else str(v)


def write_json(path: str, env: dict, rows: list[dict]) -> None:
  with open(path, "w") as f:
    json.dump({"environment": env, "rows": rows}, f, indent=1)


def write_csv(path: str, rows: list[dict]) -> None:
  cols = list(dict.fromkeys(k for r in rows for k in r))
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)


def markdown_table(rows: list[dict], cols: list[str]) -> str:
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
  return "\n".join(lines)


def line_plot(path: str, rows: list[dict], *, x: str, y: str, title: str, logx: bool = True) -> None:
  """One line per (backend, dtype) over the `ok` rows."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.2))
  series: dict[str, list[tuple]] = {}
  for r in rows:
    if r.get("status") == "ok" and r.get(y) is not None:
      series.setdefault(f"{r['backend']} {r['dtype']}", []).append((r[x], r[y]))
  for label, pts in sorted(series.items()):
    pts.sort()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
  if logx:
    ax.set_xscale("log", base=2)
  ax.set_xlabel(x)
  ax.set_ylabel(y)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  if series:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def bar_plot(path: str, rows: list[dict], *, y: str, title: str) -> None:
  """One bar per row; unavailable rows show as an empty slot labelled with their status."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.2))
  labels = [f"{r['backend']}\n{r['dtype']}" for r in rows]
  values = [r.get(y) if r.get("status") == "ok" else 0.0 for r in rows]
  bars = ax.bar(range(len(rows)), values, color="tab:blue")
  for bar, r in zip(bars, rows):
    text = _fmt(r.get(y)) if r.get("status") == "ok" else r.get("status")
    ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
  ax.set_xticks(range(len(rows)), labels, fontsize=8)
  ax.set_ylabel(y)
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
