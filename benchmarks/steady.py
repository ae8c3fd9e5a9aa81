"""`python -m benchmarks.steady`: the trainer's step back to back, timed and traced in one process, with clocks.

Why: a profiler trace and a timed training run are two runs, each at the SM clock the board's
power cap left it, so their times per step need not agree. Here one process runs train.step's
own step (train.step.build: donated state, the trainer's compiler options) on one fixed batch of
random tokens, in phases, without waiting between steps (as training dispatches them):

  untimed   --warmup steps (compilation, then the clocks settle)
  timed     --steps steps, wall time per step
  traced    --trace-steps steps under jax.profiler: wall time per step and, from the trace
            (benchmarks.trace), the span of the GPU's kernels and the time some kernel ran
  timed     --steps steps again

and then an n^3 bf16 matmul, briefly (benchmarks.train's yardstick, benchmarks.common) and for
--sustain-calls calls. Every phase reports the SM clock, power and power-cap share of the busy
nvidia-smi samples taken during it (benchmarks.clocks), and the steps' model FLOP/s
(models.flops_per_token, the trainer's count) over each matmul rate.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import attnlayers
from train import flags
import models
from models import plans
from benchmarks import clocks, common, report, trace, train
from train import loop
from train.step import build

CLOCK_KEYS = ("sm_mhz", "power_w", "power_capped_share", "busy_samples")
COLUMN_NOTE = (
    "One process, phases in this order (rows), no wait between steps. `ms_per_step`: the phase's wall time over its "
    "steps. `gpu_span_ms`, `gpu_busy_ms` (traced phase): per step, first kernel start to last kernel end, and the "
    "time some kernel ran, from the profiler trace. `model_tflops`: the trainer's model FLOPs per step "
    "(models.flops_per_token: nanoGPT/PaLM's 6N + 12·L·n_head·head_dim·T per token, the full attention square even "
    "for causal, as benchmarks.train counts) over `ms_per_step`; `vs matmul`, `vs matmul, sustained`: that over the `tflops` of "
    "the n^3 bf16 matmul rows (20 calls of 10 chained matmuls, as benchmarks.train's yardstick; then "
    "`--sustain-calls` calls). `sm_mhz`, `power_w`: medians of the nvidia-smi samples (every 100 ms) taken while the "
    "GPU was busy during that phase, `busy_samples` of them; `power_capped_share`: the share of those with the "
    "driver's software power cap active.")
COLS = ["phase", "steps", "calls", "ms_per_step", "gpu_span_ms", "gpu_busy_ms", "model_tflops", "tflops", "vs matmul",
        "vs matmul, sustained", *CLOCK_KEYS]


def phases(step, state, batch, a, trace_dir: str) -> tuple[list[dict], dict]:
  """The step's phases (module docstring), each {phase, steps, ms_per_step, CLOCK_KEYS[, gpu_span_ms, gpu_busy_ms]}."""
  rows = []

  def phase(name: str, n: int, traced: bool = False) -> None:
    nonlocal state
    with clocks.Sampler(period_ms=100) as gpu:
      if traced:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
      try:
        t = time.perf_counter()
        for i in range(n):
          state, loss = step(state, batch, i)
        jax.block_until_ready(loss)
        wall = time.perf_counter() - t
      finally:  # a step that raises leaves no profiler running
        if traced:
          jax.profiler.stop_trace()
    row = {"phase": name, "steps": n, "ms_per_step": wall / n * 1e3} | {k: gpu.summary()[k] for k in CLOCK_KEYS}
    if traced:
      span = trace.gpu_span(trace.load(trace_dir))  # None where the trace holds no GPU kernel (a CPU run)
      row |= {"gpu_span_ms": span and span[0] / n / 1e3, "gpu_busy_ms": span and span[1] / n / 1e3}  # from us
    rows.append(row)
    print(json.dumps(row), flush=True)

  phase("warmup", a.warmup)
  phase("timed", a.steps)
  phase("traced", a.trace_steps, traced=True)
  phase("timed again", a.steps)
  return rows, state


def matmuls(n: int, sustain_calls: int) -> list[dict]:
  """The yardstick matmul briefly (as benchmarks.train times it), then for sustain_calls calls, with clocks."""
  rows = []
  for name, calls in (("matmul", 20), ("matmul, sustained", sustain_calls)):
    with clocks.Sampler(period_ms=100) as gpu:
      tflops = common.matmul_tflops(n=n, calls=calls)
    rows.append({"phase": name, "calls": calls, "tflops": tflops} | {k: gpu.summary()[k] for k in CLOCK_KEYS})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def main(argv=None) -> list[dict]:
  p = flags.Parser(prog="python -m benchmarks.steady", description=flags.description(__doc__))
  p.add_argument("--attn", choices=attnlayers.BACKENDS, default="cudnn")
  p.add_argument("--preset", choices=list(models.PRESETS), default="gpt2-small")
  p.add_argument("--seq-len", type=flags.int_at_least(1), help="default: the preset's context (1024 for gpt2-small)")
  p.add_argument("--batch-size", type=flags.int_at_least(1), default=32, help="rows of the step's batch (default 32)")
  p.add_argument("--warmup", type=int, default=10, help="steps run first, not reported as a result")
  p.add_argument("--steps", type=int, default=100, help="steps in each timed phase")
  p.add_argument("--trace-steps", type=int, default=10, help="steps in the traced phase")
  p.add_argument("--matmul-n", type=int, help="the yardstick matmul's size (n^3); default 8192 on a GPU, 512 elsewhere")
  p.add_argument("--sustain-calls", type=int, default=200, help="calls of the sustained matmul (10 matmuls each)")
  p.add_argument("--out", default="runs/benchmarks", help="folder for steady.json and steady.md")
  a = p.parse_args(argv)
  common.check_out(p, a.out)  # before any timing: rows that cannot be written are never timed
  a.seq_len = models.PRESETS[a.preset].seq_len if a.seq_len is None else a.seq_len
  if a.matmul_n is None:
    a.matmul_n = common.yardstick_n()
  for flag in ("warmup", "steps", "trace_steps", "matmul_n", "sustain_calls"):
    if getattr(a, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be at least 1; got {getattr(a, flag)}")
  fp8_core = {"fp8_core": train.FP8_CORE} if a.attn == "te-fp8" else {}  # as benchmarks.train runs te-fp8
  try:
    mcfg = models.preset(a.preset, backend=a.attn, seq_len=a.seq_len, **fp8_core)
  except ValueError as e:
    p.error(str(e))
  common.refuse_unless_runnable({f"--attn {a.attn}": plans.attention_plans(mcfg, a.batch_size, a.seq_len)},
                                "This benchmark times the training step with that attention kernel: run it where "
                                "the kernel runs, or give another --attn")
  cfg = loop.TrainConfig(model=mcfg, batch_size=a.batch_size, steps=a.warmup + 2 * a.steps + a.trace_steps,
                         progress=False)
  model, state = build(cfg, NamedSharding(loop.data_mesh(jax.devices()[:1]), P()))
  x = jax.random.randint(jax.random.key(1), (a.batch_size, a.seq_len), 0, mcfg.vocab_size)  # (B, T)
  batch = {"inputs": x, "targets": jnp.roll(x, -1, axis=1)}
  with tempfile.TemporaryDirectory(prefix="attnlayers-steady-") as trace_dir:
    rows, state = phases(model.train_step, state, batch, a, trace_dir)
  rows += matmuls(a.matmul_n, a.sustain_calls)
  per_token, tokens_per_step = models.flops_per_token(mcfg, model.n_params, a.seq_len), a.batch_size * a.seq_len
  yardsticks = {r["phase"]: r["tflops"] for r in rows if "tflops" in r}
  for r in rows:
    if "ms_per_step" in r and r["phase"] != "warmup":  # the warm-up's first step compiles
      tokens_per_s = tokens_per_step / (r["ms_per_step"] * 1e-3)
      r["model_tflops"] = train.model_flop_rate(a.attn, tokens_per_s, per_token) / 1e12  # raises above the peak
      r |= {f"vs {k}": r["model_tflops"] / v for k, v in yardsticks.items()}
  env = common.environment() | {"config": vars(a)}
  print(json.dumps(env))
  print(report.markdown_table(rows, COLS))
  write(a.out, env, rows)
  return rows


def write(out: str, env: dict, rows: list[dict]) -> None:
  """steady.json and steady.md in `out`."""
  os.makedirs(out, exist_ok=True)
  report.write_json(os.path.join(out, "steady.json"), env, rows)
  with open(os.path.join(out, "steady.md"), "w") as f:
    f.write(f"# The training step back to back: timed, traced, clocked\n\n{env}\n\n{COLUMN_NOTE}\n\n"
            + report.markdown_table(rows, COLS) + "\n")


if __name__ == "__main__":
  main()
