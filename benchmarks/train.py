"""`python -m benchmarks.train`: short GPT training runs per attention backend, side by side.

Each run is its own `python -m train` process. For each backend: steps/s, tokens/s, MFU
(nanoGPT/PaLM's count, models.flops_per_token: the full T x T attention square even for
causal, over the device's datasheet dense bf16 peak), the same model FLOP/s as a fraction
of an 8192^3 bf16 matmul that this benchmark's parent process times right after the
training runs (same machine and invocation; the GPU is free of the children by then), time
to first step, peak memory and the loss after the run. te-fp8 runs with --fp8-core
fp8-or-bf16, so a model whose head dim does not qualify for the FP8 core trains with FP8
projections and a bf16 core (its row's attention_notes, the trainer's summary of how its attention
calls ran, says so). A backend that cannot run is a row with its reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import attnlayers
from train import flags
import models
from benchmarks import clocks, common, flops, report
from train import data, metrics


PACKINGS = ("unpacked", "packed")
BIASES = ("with", "without")  # the preset's biases in every Linear and LayerNorm, or none (train --no-bias)
PACK_NOTE = ("`packing`: unpacked windows of one text, or packed documents (train --pack: segment ids stop "
             "attention at document boundaries); neither pads, so tokens_per_s counts only real tokens. "
             "`vs_unpacked`: tokens_per_s over the unpacked run's of the same backend and shape. `val_loss`: at the "
             "last step, on the same unpacked held-out windows for both. `bias`: the model with GPT-2's biases in its "
             "Linears and LayerNorms, or without any (train --no-bias, as nanoGPT's train.py trains by default); "
             "a ratio is always against a row with the same biases.")
CLOCK_COLS = ("sm_mhz", "power_w", "power_capped_share", "busy_samples")  # per run, from benchmarks.clocks
FP8_CORE = "fp8-or-bf16"  # te-fp8 rows: FP8 core where the model's head dim qualifies, else bf16
COLUMN_NOTE = ("`vs_cudnn`, `vs_xla`: tokens_per_s over the cudnn (xla) run's of the same preset, shape, packing and "
               "biases (same benchmark). "
               "`mfu`: nanoGPT/PaLM model FLOPs (6N + 12·L·n_head·head_dim·T per token, full attention square "
               "even for causal) over the datasheet dense bf16 peak. `vs_matmul`: the same model FLOP/s over a "
               "bf16 matmul of size `matmul_n`³ timed by this benchmark's parent process after the runs (20 calls, "
               "about 0.3 s on an H200); `vs_sustained_matmul`: over the same matmul run for 200 calls (the "
               "environment's `sustained_matmul_bf16_tflops`), long enough to run at the clock a power cap leaves, "
               "as a training run does. "
               "`sm_mhz`, `power_w`: medians over the nvidia-smi samples of the GPU taken while it was busy "
               "(utilization >= 90%) during the run, `busy_samples` of them (power: nvidia-smi's ~1 s average); "
               "`power_capped_share`: the fraction of those samples with the driver's software power cap active. "
               "The same for a ~3 s run of the matmul, with the board's maximum SM clock and power limit: the "
               "environment's `sustained_matmul_*` entries above.")


def run_one(backend: str, preset: str, seq_len: int, batch_size: int, steps: int, timeout_s: float,
            packing: str = "unpacked", data: str | None = None, evaluate: bool = False, bias: str = "with") -> dict:
  """One `python -m train` process per run, so compilation caches and peak memory are its own. Packed runs
  (train --pack) are validated, at their last step, on the same unpacked windows as unpacked ones. bias:
  "with" (the preset's biases) or "without" (train --no-bias)."""
  row = {"backend": backend, "preset": preset, "seq_len": seq_len, "batch_size": batch_size, "steps": steps,
         "packing": packing, "bias": bias}
  cmd = [sys.executable, "-m", "train", "--attn", backend, "--preset", preset, "--seq-len", str(seq_len),
         "--batch-size", str(batch_size), "--steps", str(steps), "--warmup", str(min(10, steps)),
         "--eval-every", str(steps if evaluate else 0),
         "--log-every", str(max(1, steps // 6)), "--sample-tokens", "0", "--no-progress", "--no-ckpt"]
  cmd += ["--pack"] if packing == "packed" else []
  cmd += ["--no-bias"] if bias == "without" else []
  cmd += ["--data", data] if data else []
  if backend == "te-fp8":
    cmd += ["--fp8-core", FP8_CORE]
    row["fp8_core"] = FP8_CORE
  with tempfile.TemporaryDirectory() as tmp:  # the run's summary record is read from its --metrics file
    try:
      with clocks.Sampler() as gpu:
        proc = subprocess.run([*cmd, "--metrics", os.path.join(tmp, "m.jsonl")], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=timeout_s)
    except subprocess.TimeoutExpired:
      return row | {"status": "error", "reason": f"did not finish within --run-timeout {timeout_s:.0f} s"}
    records = open(os.path.join(tmp, "m.jsonl")).read().splitlines() if proc.returncode == 0 else []
  if proc.returncode != 0:
    reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
    unavailable = "cannot run" in proc.stderr
    return row | {"status": "unavailable" if unavailable else "error", "reason": _reasons(proc.stderr) or reason}
  s = metrics.loads([line for line in records if line.startswith('{"event": "summary"')][-1])
  model = models.preset(preset, seq_len=seq_len)
  per_token = models.flops_per_token(model, s["params_for_flops"], seq_len)  # model_tflops: main, after the runs
  return row | {"status": "ok", "steps_per_s": s["steps_per_s"], "tokens_per_s": s["tokens_per_s"],
                "mfu": s["mfu"], "flops_per_token": per_token,
                "time_to_first_step_s": s["time_to_first_step_s"],
                "peak_memory_gib": s["peak_memory_bytes"] and s["peak_memory_bytes"] / 2**30,
                "final_loss": s["final_loss"], "val_loss": s.get("final_val_loss"),
                "attention_notes": "; ".join(s.get("attention_notes") or []) or None, **_clocks(gpu)}


def model_flop_rate(backend: str, tokens_per_s: float, flops_per_token: float) -> float:
  """A run's model FLOP/s; flops.ImpossibleRate, which stops the benchmark, above the device's dense peak
  (FP8's for te-fp8, whose GEMMs may pass bf16's; bf16's otherwise), as for every per-call rate."""
  peak, peak_name = common.dense_peak("fp8" if backend == "te-fp8" else "bf16")
  return flops.check_rate(f"{backend} training", tokens_per_s * flops_per_token, 1.0, peak, peak_name)


def _clocks(gpu: clocks.Sampler) -> dict:
  """A run's CLOCK_COLS, and clock_error where nvidia-smi printed something else."""
  summary = gpu.summary()
  return {k: summary[k] for k in CLOCK_COLS} | ({"clock_error": summary["error"]} if summary["error"] else {})


def _reasons(stderr: str) -> str:
  return "; ".join(line.strip()[2:] for line in stderr.splitlines() if line.strip().startswith("- "))


def table(rows: list[dict]) -> str:
  cols = ["backend", "preset", "fp8_core", "packing", "bias", "seq_len", "batch_size", "status", "steps_per_s", "tokens_per_s",
          "vs_unpacked", "vs_cudnn", "vs_xla", "mfu", "vs_matmul", "vs_sustained_matmul", "time_to_first_step_s", "peak_memory_gib",
          "final_loss", "val_loss", *CLOCK_COLS]
  cols = [c for c in cols if any(r.get(c) is not None for r in rows)]  # e.g. no vs_cudnn or fp8_core on a TPU
  reasons = [f"\n{r['backend']}: {r['reason']}" for r in rows if r["status"] != "ok"]
  notes = sorted({f"\n{r['backend']} T={r['seq_len']}: {r['attention_notes']}" for r in rows if r.get("attention_notes")})
  return report.markdown_table(rows, cols) + "\n" + "\n".join(reasons + notes)


def main(argv=None) -> None:
  p = flags.Parser(prog="python -m benchmarks.train", description=flags.description(__doc__))
  one = flags.int_at_least(1)
  p.add_argument("--backends", nargs="+", choices=attnlayers.BACKENDS, default=["naive", "xla", "cudnn", "te", "te-fp8"],
                 help="one training run each; default: naive xla cudnn te te-fp8")
  p.add_argument("--preset", choices=list(models.PRESETS), default="gpt2-small", help="default: gpt2-small")
  p.add_argument("--seq-len", type=one, nargs="+",
                 help="default: the preset's context (1024 for gpt2-small)")
  p.add_argument("--batch-size", type=one, nargs="+", default=[32],
                 help="global batch; one value for every --seq-len, or one per --seq-len; default: 32")
  p.add_argument("--steps", type=flags.int_at_least(2), default=40,
                 help="steps per run, at least 2 (default 40): the first step compiles and no interval ends at it, so "
                      "the rate is the median of the reported intervals after the first")
  p.add_argument("--packing", nargs="+", choices=PACKINGS, default=["unpacked"],
                 help="unpacked windows, packed documents (train --pack), or both side by side; with packed, every "
                      "run reports val_loss at its last step (the same unpacked windows in both modes)")
  p.add_argument("--bias", nargs="+", choices=BIASES, default=["with"],
                 help="the model with the preset's biases in its Linears and LayerNorms (GPT-2's), without any "
                      "(train --no-bias, nanoGPT's train.py default), or both side by side; default: with")
  p.add_argument("--data", type=flags.path("leave out --data to train on the default text"),
                 help="train --data (default: the embedded corpus)")
  p.add_argument("--run-timeout", type=flags.positive_float, default=300, help="seconds one training run may take")
  p.add_argument("--matmul-n", type=one,
                 help="size of the same-run matmul yardstick (n^3); default 8192 on a GPU, 512 elsewhere")
  p.add_argument("--out", default="runs/benchmarks", help="folder for train.json, .csv, .md and plots (published results: benchmarks/results/h200, written only when named here)")
  a = p.parse_args(argv)
  common.check_out(p, a.out)  # before any timing: rows that cannot be written are never timed
  report.require_plots()
  try:  # cheap; each run's trainer checks the rest of --data, as it would alone
    data.check_source(a.data)
  except (FileNotFoundError, ValueError) as e:
    p.error(str(e))
  a.seq_len = a.seq_len or [models.PRESETS[a.preset].seq_len]
  if len(a.batch_size) not in (1, len(a.seq_len)):
    p.error(f"--batch-size takes one value or one per --seq-len ({len(a.seq_len)}); got {a.batch_size}")
  batches = a.batch_size * len(a.seq_len) if len(a.batch_size) == 1 else a.batch_size
  rows = []
  for seq_len, batch_size in zip(a.seq_len, batches):
    for backend in a.backends:
      for packing in a.packing:
        for bias in a.bias:
          rows.append(run_one(backend, a.preset, seq_len, batch_size, a.steps, a.run_timeout, packing, a.data,
                              evaluate="packed" in a.packing, bias=bias))
          print(json.dumps(rows[-1]), flush=True)
  # after the runs: this process opens the device (its peak, the yardstick) only once the children have let it
  # go, as a TPU admits one process at a time
  a.matmul_n = common.yardstick_n() if a.matmul_n is None else a.matmul_n
  for r in rows:
    if r["status"] == "ok":  # raises above the device's peak
      r["model_tflops"] = model_flop_rate(r["backend"], r["tokens_per_s"], r["flops_per_token"]) / 1e12
  matmul = common.matmul_tflops(n=a.matmul_n)
  with clocks.Sampler() as gpu:  # the 20-call yardstick is too short to sample: the same matmul for 200 calls
    sustained = common.matmul_tflops(n=a.matmul_n, calls=200)
  env = common.environment() | {"matmul_bf16_tflops": matmul, "matmul_n": a.matmul_n,
                                "sustained_matmul_bf16_tflops": sustained} | {
      f"sustained_matmul_{k}": v for k, v in gpu.summary().items()}
  for r in rows:
    if r["status"] == "ok":
      r["vs_matmul"] = r["model_tflops"] / matmul
      r["vs_sustained_matmul"] = r["model_tflops"] / sustained
      unpacked = [u for u in rows if u["status"] == "ok" and u["packing"] == "unpacked"
                  and all(u[k] == r[k] for k in ("backend", "seq_len", "batch_size", "bias"))]
      if r["packing"] == "packed" and unpacked:
        r["vs_unpacked"] = r["tokens_per_s"] / unpacked[0]["tokens_per_s"]
  print(json.dumps(env), flush=True)
  for base in ("cudnn", "xla"):
    add_vs(rows, base)
  print(table(rows))
  if all(r["status"] == "error" for r in rows):  # nothing measured: an earlier report in --out stays
    sys.exit(f"every run failed ({len(rows)}): see the reasons above; nothing written to {a.out}")
  write(a.out, env, rows)
  print(f"wrote train.md, train.json, train.csv and the tokens/s plots to {a.out}", flush=True)


def add_vs(rows: list[dict], base: str) -> None:
  """vs_<base>: each ok row's tokens/s over the same-run row of backend `base` of the same shape, packing and
  biases (rows from before the bias column count as with them)."""
  for r in rows:
    same = [c for c in rows if c["backend"] == base and c["status"] == "ok"
            and all(c[k] == r[k] for k in ("preset", "seq_len", "batch_size", "packing"))
            and c.get("bias", "with") == r.get("bias", "with")]
    if r["status"] == "ok" and same:
      r[f"vs_{base}"] = r["tokens_per_s"] / same[0]["tokens_per_s"]


def write(out: str, env: dict, rows: list[dict]) -> None:
  """train.json, .csv, .md and one tokens/s plot per sequence length, from the runs' rows (each names its
  preset), as main fills them in (vs_cudnn, vs_xla: add_vs)."""
  os.makedirs(out, exist_ok=True)
  report.write_json(os.path.join(out, "train.json"), env, rows)
  report.write_csv(os.path.join(out, "train.csv"), rows)
  plots = []
  presets = ", ".join(dict.fromkeys(r["preset"] for r in rows))
  biases = len({r.get("bias", "with") for r in rows}) > 1  # label the bars with them where rows differ in them
  for seq_len in dict.fromkeys(r["seq_len"] for r in rows):
    sel = [r | {"dtype": f"T{seq_len} {r['packing']}" + (f"\n{r.get('bias', 'with')} biases" if biases else "")}
           for r in rows if r["seq_len"] == seq_len]
    name = f"train_T{seq_len}_tokens_per_s.png"
    report.bar_plot(os.path.join(out, name), sel, y="tokens_per_s", title=f"{presets}, T={seq_len}: tokens/s")
    plots.append(name)
  with open(os.path.join(out, "train.md"), "w") as f:
    f.write(f"# Training benchmarks\n\n{env}\n\n{COLUMN_NOTE}\n\n{PACK_NOTE}\n\n" + table(rows) + "\n\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n")


if __name__ == "__main__":
  main()
