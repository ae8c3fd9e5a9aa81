"""`python -m benchmarks.kernels`: the kernels one decode step launches, counted in the compiled program.

models.generate's decode loop is one XLA while loop; every instruction of its body and condition that
does work (a fusion, a custom call such as a GEMM, cuDNN attention or a Pallas kernel, a copy, ...) is
one kernel launch per step. This compiles the decode program of a gpt2-small Decoder and counts those
instructions by kind, for each K (key/value heads). It compiles for:
  the GPU at hand, with XLA's autotuning: the program that runs there;
  or, with no GPU, a compile-only H200 (--target h200) described to XLA by TARGETS (a
  jax.experimental.topologies device; it needs jax's CUDA plugin, `pip install 'jax[cuda13]'`, and no
  GPU). XLA then picks each GEMM's kernel by its rules instead of by timing, so a count here may differ
  from the GPU's by the GEMMs whose choice differs (a split-K GEMM adds a reduction kernel).
A count is a compile-time figure: benchmarks.decode's kernels_per_step, from a profiler trace of the
running loop, is the measurement. This tool is for changing the step on a machine without a GPU and
checking what XLA makes of it.

Writes kernels.json and kernels.md to --out (one row per K, the kinds as columns).
"""

from __future__ import annotations

import argparse
import collections
import os
import re

import jax

import models
from benchmarks import common, report
from benchmarks.decode import XLA_OPTIONS
from models import generate

# What XLA is told of a compile-only GPU (stream_executor.GpuTargetConfigProto, text format): the H200's
# limits and sizes as its device query reports them.
TARGETS = {"h200": """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200"
"""}
NO_WORK = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all"}  # no kernel of their own
_INSTRUCTION = re.compile(r"^(?:ROOT )?%?[\w.\-]+ = .*? ([\w\-]+)\(")


def target_device(name: str):
  """The device to compile for: the GPU at hand ("auto" with one), or a compile-only one of TARGETS."""
  if name == "auto":
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if gpus:
      return gpus[0]
    name = "h200"
  from jax.experimental import topologies
  try:
    return topologies.get_topology_desc("kernels", "cuda", target_config=TARGETS[name], topology="1x1x1").devices[0]
  except (RuntimeError, NotImplementedError, jax.errors.JaxRuntimeError) as e:
    raise SystemExit(f"error: cannot compile for an {name} without a GPU here ({str(e).splitlines()[0]}): that needs "
                     "jax's CUDA plugin, e.g. pip install 'jax[cuda13]' (no GPU needed)") from None


def _computations(hlo: str) -> dict[str, list[str]]:
  """Each computation's instruction lines by name; the entry computation also as "ENTRY"."""
  comps, lines = {}, None
  for line in hlo.splitlines():
    if m := re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line):
      lines = comps[m.group(2)] = []
      if m.group(1):
        comps["ENTRY"] = lines
    elif lines is not None and line.startswith("  "):
      lines.append(re.sub(r"/\*.*?\*/", "", line.strip()))  # /*index=5*/ comments hold '='
  return comps


def kind(line: str) -> str | None:
  """The kind of kernel one HLO instruction launches ("fusion:kLoop", "custom-call:__cudnn$fmhaSoftmax", "copy"),
  None for one that launches none."""
  m = _INSTRUCTION.match(line)
  if m is None or m.group(1) in NO_WORK:
    return None
  op = m.group(1)
  if op == "fusion":
    fusion, emitter = re.search(r"kind=(\w+)", line).group(1), re.search(r'"kind":"(\w+)"', line)
    return f"fusion:{fusion}" + (f":{emitter.group(1)}" if emitter else "")
  if op == "custom-call":
    return "custom-call:" + re.search(r'custom_call_target="([^"]+)"', line).group(1)
  return op


def loop_kernels(hlo: str) -> collections.Counter:
  """The kernels of one step of the program's (first) while loop, by kind: its body's and its condition's. A `call`
  (a command buffer's computation, where XLA outlines one) counts as the kernels it holds."""
  comps = _computations(hlo)
  loop = _find_while(comps, "ENTRY")
  if loop is None:
    raise ValueError("the program has no while loop in its entry computation")
  counts = collections.Counter()
  for part in ("body", "condition"):
    _add_kernels(comps, re.search(part + r"=%?([\w.\-]+)", loop).group(1), counts)
  return counts


def _called(line: str) -> str:
  return re.search(r"to_apply=%?([\w.\-]+)", line).group(1)


def _find_while(comps: dict, name: str) -> str | None:
  """The first while instruction of computation `name`, or of a computation it calls."""
  for line in comps[name]:
    if (k := kind(line)) == "while":
      return line
    if k == "call" and (found := _find_while(comps, _called(line))) is not None:
      return found
  return None


def _add_kernels(comps: dict, name: str, counts: collections.Counter) -> None:
  for line in comps[name]:
    if (k := kind(line)) == "call":
      _add_kernels(comps, _called(line), counts)
    elif k is not None:
      counts[k] += 1


def count(device, *, preset: str, K: int, batch: int, context: int, steps: int, backend: str, options: str,
          sampling: generate.Sampling) -> collections.Counter:
  """loop_kernels of the decode program of a `preset` Decoder (K kv heads) compiled for `device`."""
  seq_len = max(models.PRESETS[preset].seq_len, context + steps)  # the preset's, or a longer one the cache fits
  cfg = models.preset(preset, n_kv_head=K, backend=backend, seq_len=seq_len)
  with jax.default_device(device):
    lowered = generate.lower_decode(cfg, batch=batch, cache_len=context + steps,
                                    sampling=sampling, compiler_options=XLA_OPTIONS[options],
                                    sharding=jax.sharding.SingleDeviceSharding(device))
    return loop_kernels(lowered.compile().as_text())


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
  p.add_argument("--target", default="auto", choices=["auto", *TARGETS],
                 help="auto: the GPU at hand, else a compile-only h200")
  p.add_argument("--preset", default="gpt2-small", choices=list(models.PRESETS))
  p.add_argument("--kv-heads", type=int, nargs="+", default=[12, 4, 1])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--context", type=int, default=1536, help="cache positions before the loop's steps")
  p.add_argument("--steps", type=int, default=64)
  p.add_argument("--backend", default="cudnn")
  p.add_argument("--xla-options", default="decode", choices=list(XLA_OPTIONS))
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--out", default="runs/benchmarks", help="folder for kernels.json and kernels.md")
  a = p.parse_args(argv)
  common.check_out(p, a.out)
  try:
    sampling = generate.Sampling(temperature=a.temperature, top_k=a.top_k)
  except ValueError as e:
    p.error(str(e))
  device = target_device(a.target)
  rows = []
  for K in a.kv_heads:
    counts = count(device, preset=a.preset, K=K, batch=a.batch, context=a.context, steps=a.steps,
                   backend=a.backend, options=a.xla_options, sampling=sampling)
    rows.append({"K": K, "kernels_per_step": sum(counts.values()), **dict(counts.most_common())})
    print(rows[-1], flush=True)
  env = common.environment() | {"target": str(device.device_kind), "compiled_for": "the GPU at hand, autotuned"
                                if device in jax.devices() else "compile-only, not autotuned",
                                "preset": a.preset, "batch": a.batch, "context": a.context, "backend": a.backend,
                                "xla_options": a.xla_options, "temperature": a.temperature, "top_k": a.top_k}
  os.makedirs(a.out, exist_ok=True)
  report.write_json(f"{a.out}/kernels.json", env, rows)
  cols = ["K", "kernels_per_step", *sorted({k for r in rows for k in r} - {"K", "kernels_per_step"})]
  with open(f"{a.out}/kernels.md", "w", encoding="utf-8") as f:
    f.write(f"# Kernels per decode step, compiled for {env['target']} ({env['compiled_for']})\n\n"
            f"{a.preset}, batch {a.batch}, context {a.context}, {a.backend}, XLA options {a.xla_options}, "
            f"{'greedy' if a.temperature == 0 else f'temperature {a.temperature}, top_k {a.top_k}'}\n\n"
            f"{report.markdown_table(rows, cols)}\n")
  print(report.markdown_table(rows, cols))


if __name__ == "__main__":
  main()
