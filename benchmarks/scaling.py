"""`python -m benchmarks.scaling`: the scaling model's tables (benchmarks.scaling_model) for gpt-1b and gpt-7b at
8, 64 and 512 devices, data parallel (DP), fully sharded (FSDP) and fully sharded with tensor parallelism
(FSDP+TP), and its check against the step XLA compiles for 8 CPU devices (benchmarks.scaling_check).

Writes scaling.json and scaling.md to --out (default runs/benchmarks; the published ones are in
benchmarks/results/cpu-8) and prints their tables; docs/scaling.md quotes them. Runs on a CPU: nothing is
allocated, the check compiles from abstract arrays.
"""

from __future__ import annotations

import argparse
import os

import models
from benchmarks import common, report, scaling_check, scaling_model

DEVICES = (8, 64, 512)  # the device counts the tables cover
PRESETS = ("gpt-1b", "gpt-7b")
TENSOR = 8  # FSDP+TP's tensor axis: the GPUs of one node, joined by NVLink; fsdp spans the nodes
GIB = 2**30


def layouts(n: int) -> dict[str, dict[str, int]]:
  """The mesh of each layout on n devices, as train.mesh sizes it ({data, fsdp, tensor})."""
  return {"DP": {"data": n, "fsdp": 1, "tensor": 1}, "FSDP": {"data": 1, "fsdp": n, "tensor": 1},
          "FSDP+TP": {"data": 1, "fsdp": n // TENSOR, "tensor": TENSOR}}


def table_rows(name: str, rows: int = scaling_model.ROWS) -> list[dict]:
  """One row per (devices, layout) for preset `name`: memory in GiB and collective GB per device per step."""
  cfg = models.preset(name)
  out = []
  for n in DEVICES:
    for layout, sizes in layouts(n).items():
      m = scaling_model.memory(cfg, sizes, rows)
      wire = scaling_model.per_kind(scaling_model.transfers(cfg, sizes, rows), scaling_model.wire_bytes)
      out.append({"preset": name, "devices": n, "layout": layout,
                  "mesh": scaling_model.describe(sizes),
                  **{f"{k}_gib": round(v / GIB, 3) for k, v in m.items()},
                  **{f"{k}_gb": round(wire.get(k, 0) / 1e9, 3) for k in ("all-gather", "reduce-scatter", "all-reduce")},
                  "comm_gb": round(sum(wire.values()) / 1e9, 3)})
  return out


MEMORY_COLS = ["preset", "devices", "layout", "mesh", "params_gib", "grads_gib", "optimizer_gib", "gathered_gib",
               "activations_gib", "total_gib", "all-gather_gb", "reduce-scatter_gb", "all-reduce_gb", "comm_gb"]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="runs/benchmarks",
                 help="folder for scaling.json and scaling.md (published: benchmarks/results/cpu-8, "
                      "written only when named here)")
  p.add_argument("--no-check", action="store_true", help="the model's tables only: skip compiling on 8 CPU devices")
  a = p.parse_args(argv)
  common.check_out(p, a.out)
  check, largest, memory = ([], [], []) if a.no_check else scaling_check.rows()  # first: it sets up 8 CPU devices
  sections = []
  tables = {}
  for name in PRESETS:
    tables[name] = table_rows(name)
    cfg = models.preset(name)
    sections.append(f"## {name}: {_describe(cfg)}, b={scaling_model.ROWS} row of T={cfg.seq_len} per "
                    "data-parallel rank\n\n"
                    + report.markdown_table(tables[name], MEMORY_COLS))
  if check:
    sections.append(scaling_check.markdown(check, largest, memory))
  text = "\n\n".join(sections)
  os.makedirs(a.out, exist_ok=True)
  env = common.environment()
  rows = [r for rs in tables.values() for r in rs] + check + largest + memory
  report.write_json(os.path.join(a.out, "scaling.json"), env, rows)
  with open(os.path.join(a.out, "scaling.md"), "w") as f:
    f.write(f"# Scaling model: per-device memory (GiB) and collective bytes per step (GB, by a ring)\n\n"
            f"{env}\n\n{text}\n")
  print(text)


def _describe(cfg: models.GPTConfig) -> str:
  return (f"{cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads ({cfg.n_kv_head or cfg.n_head} kv), "
          f"{cfg.param_dtype} params, {cfg.dtype} compute")


if __name__ == "__main__":
  main()
