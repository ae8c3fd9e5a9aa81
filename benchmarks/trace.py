"""`python -m benchmarks.trace TRACE`: where GPU time goes in a profiler trace.

Reads the perfetto_trace.json.gz that `python -m train --profile-dir` (jax.profiler)
writes and prints, for the GPU: the span, the time some kernel was running, the idle
rest, time and kernels run per kernel family (matmul, attention, other fused XLA kernels,
copies), the same split by the part of the step each kernel belongs to, and the longest kernels
by total time.

The part comes from the JAX operation each kernel ran for (the trace's op name): "backward"
where jax.grad transposed it (`transpose(...)` in the name), "forward" where it differentiated
it (`jvp(...)`, the forward pass that the backward follows), "rest" for other names (what the
step does outside the gradient: the optimizer update), and "unnamed" for kernels whose event
carries no op name. XLA launches most of a step's kernels from CUDA graphs (its command
buffers, on by default), and those events come without one, so a trace of the trainer's step is
mostly "unnamed"; the families above are unaffected. XLA's own flag names them, at the cost of
running the step without CUDA graphs: XLA_FLAGS=--xla_gpu_enable_command_buffer= for the traced run.
Such a trace also names each kernel's XLA instruction (hlo_op), and the time is split by its kind
(input_reduce_fusion, loop_add_fusion, pallas_call, dot_product_attention_bwd, ...) and part; an
optimized-HLO dump of the same run (--xla_dump_to) says what each instruction computes.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

from train import flags


FAMILIES = [  # first match wins
    ("attention (cuDNN/flash)", re.compile(r"cudnn|fmha|flash|fprop|dgrad|sdpa", re.I)),
    ("matmul (cuBLAS/GEMM)", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|wgmma|sm90_", re.I)),
    ("copies/memset", re.compile(r"memcpy|memset|copy", re.I)),
    ("other (XLA fusions, Pallas)", re.compile(r".")),
]
PARTS = [("backward", re.compile(r"transpose\(")), ("forward", re.compile(r"jvp\(")), ("rest", re.compile(r".")),
         ("unnamed", re.compile(r""))]


UNNAMED_OP = "(no XLA op named)"


def family(kernel: str) -> str:
  return next(f for f, rx in FAMILIES if rx.search(kernel))


def part(op_name: str) -> str:
  """"backward", "forward", "rest" or "unnamed" for the op name a kernel's trace event carries (module docstring)."""
  return next(p for p, rx in PARTS if rx.search(op_name))


class TraceError(ValueError):
  """The path given is not a trace this reads; the message names it and why."""


def load(path: str) -> list[dict]:
  """The events of a perfetto_trace.json.gz, or of the newest one under a folder; TraceError where there is none."""
  if os.path.isdir(path):
    found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True))
    if not found:
      raise TraceError(f"{path} holds no perfetto_trace.json.gz (in it or a folder below)")
    path = found[-1]
  try:
    with gzip.open(path) as f:
      d = json.load(f)
  except FileNotFoundError:
    raise TraceError(f"{path}: no such file or folder") from None
  except (OSError, EOFError, ValueError) as e:  # not gzip, cut short, not JSON
    raise TraceError(f"{path} is not a gzipped JSON trace ({type(e).__name__}: {e})") from None
  return d["traceEvents"] if isinstance(d, dict) else d


def gpu_kernels(events: list[dict]) -> list[dict]:
  """The trace's GPU kernel (and copy) events, with their durations."""
  gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and "GPU" in str(e.get("args", {}).get("name", ""))}
  return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and e.get("dur")]


def gpu_span(events: list[dict]) -> tuple[float, float] | None:
  """(span, busy) in microseconds: first kernel start to last kernel end, and the time some kernel ran (the
  union of their intervals over all streams); None where the trace holds no GPU kernel."""
  return _span(gpu_kernels(events))


def _span(kernels: list[dict]) -> tuple[float, float] | None:
  spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
  if not spans:
    return None
  busy, end = 0.0, spans[0][0]
  for a, b in spans:
    if b > end:
      busy += b - max(a, end)
      end = b
  return spans[-1][1] - spans[0][0], busy


def summarize(events: list[dict]) -> dict:
  kernels = gpu_kernels(events)
  if not kernels:
    raise SystemExit("no GPU kernels in this trace (was it recorded on a GPU?)")
  span, busy = _span(kernels)
  by_name = collections.Counter()
  for e in kernels:
    by_name[e["name"]] += e["dur"]
  by_family, by_part, counts = collections.Counter(), collections.Counter(), collections.Counter()
  for e in kernels:
    f, p = family(e["name"]), part(str(e.get("args", {}).get("name", "")))
    by_family[f] += e["dur"]
    by_part[p, f] += e["dur"]
    counts[f] += 1
  by_op, op_counts = collections.Counter(), collections.Counter()
  for e in kernels:
    key = op_kind(e), part(str(e.get("args", {}).get("name", "")))
    by_op[key] += e["dur"]
    op_counts[key] += 1
  return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "kernel_ms": sum(by_name.values()) / 1e3,
          "families_ms": {k: v / 1e3 for k, v in by_family.most_common()},
          "kernels": dict(counts),
          "parts_ms": {p: {f: by_part[p, f] / 1e3 for f, _ in by_family.most_common() if by_part[p, f]}
                       for p, _ in PARTS},
          "top_kernels_ms": {k: v / 1e3 for k, v in by_name.most_common(15)},
          "top_ops_ms": {k: v / 1e3 for k, v in by_op.most_common(15)},
          "op_kernels": {k: op_counts[k] for k, _ in by_op.most_common(15)}}


def op_kind(event: dict) -> str:
  """The kind of XLA instruction a kernel ran for: its trace event's hlo_op without the instruction's number
  ("input_reduce_fusion.19" -> "input_reduce_fusion"), or UNNAMED_OP where the event names none (CUDA graphs)."""
  op = str(event.get("args", {}).get("hlo_op", ""))
  return re.sub(r"(\.\d+)?(#\d+)?$", "", op) or UNNAMED_OP


def main(argv=None) -> None:
  p = flags.Parser(prog="python -m benchmarks.trace", description=flags.description(__doc__))
  p.add_argument("trace", help="perfetto_trace.json.gz, or a folder holding one")
  p.add_argument("--steps", type=flags.int_at_least(1), default=5, help="steps in the trace, for per-step figures")
  a = p.parse_args(argv)
  try:
    events = load(a.trace)
  except TraceError as e:
    p.error(f"{e}; give a perfetto_trace.json.gz or a folder holding one, as python -m train --profile-dir writes")
  s = summarize(events)
  n = a.steps
  print(f"GPU span {s['span_ms'] / n:.2f} ms/step, busy {s['busy_ms'] / n:.2f} ms/step "
        f"({s['busy_ms'] / s['span_ms']:.1%}), idle {(s['span_ms'] - s['busy_ms']) / n:.2f} ms/step")
  for k, v in s["families_ms"].items():
    print(f"  {k:<26} {v / n:8.2f} ms/step  {v / s['kernel_ms']:6.1%}  {s['kernels'][k] / n:6.1f} kernels/step")
  print("by part of the step (ms/step):")
  for p, fams in s["parts_ms"].items():
    if not fams:
      continue
    print(f"  {p:<9} {sum(fams.values()) / n:8.2f}  " + ", ".join(f"{f} {v / n:.2f}" for f, v in fams.items()))
  print("by kind of XLA op and part of the step (ms/step, kernels/step):")
  for (op, p), v in s["top_ops_ms"].items():
    print(f"  {v / n:8.2f}  {s['op_kernels'][op, p] / n:7.1f}  {op} ({p})")
  print("longest kernels (ms/step):")
  for k, v in s["top_kernels_ms"].items():
    print(f"  {v / n:8.2f}  {k[:110]}")


if __name__ == "__main__":
  main()
