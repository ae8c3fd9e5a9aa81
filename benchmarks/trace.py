"""`python -m benchmarks.trace TRACE`: where GPU time goes in a profiler trace.

Reads the perfetto_trace.json.gz that `python -m train --profile-dir` (jax.profiler)
writes and prints, for the GPU: the span, the time some kernel was running, the idle
rest, time per kernel family (matmul, attention, other fused XLA kernels, copies) and the
longest kernels by total time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

FAMILIES = [  # first match wins
    ("attention (cuDNN/flash)", re.compile(r"cudnn|fmha|flash|fprop|dgrad|sdpa", re.I)),
    ("matmul (cuBLAS/GEMM)", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|wgmma|sm90_", re.I)),
    ("copies/memset", re.compile(r"memcpy|memset|copy", re.I)),
    ("other XLA fusions", re.compile(r".")),
]


def load(path: str) -> list[dict]:
  if os.path.isdir(path):
    path = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
  with gzip.open(path) as f:
    d = json.load(f)
  return d["traceEvents"] if isinstance(d, dict) else d


def summarize(events: list[dict]) -> dict:
  gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and "GPU" in str(e.get("args", {}).get("name", ""))}
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and e.get("dur")]
  if not kernels:
    raise SystemExit("no GPU kernels in this trace (was it recorded on a GPU?)")
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
  busy, end = 0.0, spans[0][0]
  for a, b in spans:  # union of kernel intervals over all streams
    if b > end:
      busy += b - max(a, end)
      end = b
  span = spans[-1][1] - spans[0][0]
  by_name = collections.Counter()
  for e in kernels:
    by_name[e["name"]] += e["dur"]
  by_family = collections.Counter()
  for name, dur in by_name.items():
    by_family[next(f for f, rx in FAMILIES if rx.search(name))] += dur
  return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "kernel_ms": sum(by_name.values()) / 1e3,
          "families_ms": {k: v / 1e3 for k, v in by_family.most_common()},
          "top_kernels_ms": {k: v / 1e3 for k, v in by_name.most_common(15)}}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.trace", description=__doc__.splitlines()[0])
  p.add_argument("trace", help="perfetto_trace.json.gz, or a folder holding one")
  p.add_argument("--steps", type=int, default=5, help="steps in the trace, for per-step figures")
  a = p.parse_args(argv)
  s = summarize(load(a.trace))
  n = a.steps
  print(f"GPU span {s['span_ms'] / n:.2f} ms/step, busy {s['busy_ms'] / n:.2f} ms/step "
        f"({s['busy_ms'] / s['span_ms']:.1%}), idle {(s['span_ms'] - s['busy_ms']) / n:.2f} ms/step")
  for k, v in s["families_ms"].items():
    print(f"  {k:<26} {v / n:8.2f} ms/step  {v / s['kernel_ms']:6.1%}")
  print("longest kernels (ms/step):")
  for k, v in s["top_kernels_ms"].items():
    print(f"  {v / n:8.2f}  {k[:110]}")


if __name__ == "__main__":
  main()
