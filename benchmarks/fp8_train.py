"""`python -m benchmarks.fp8_train`: does te-fp8 train like bf16? The same model, data and
seed under a bf16 backend (`--baseline`, default te) and `te-fp8`, with the loss of both
side by side.

The default model (`--preset tiny` widened to 4 layers, 4 heads, d_model 512, T 512) has head
dim 128 and T a multiple of 128, so te-fp8's attention core runs in FP8 (cuDNN FP8 forward)
and every GEMM of its blocks (fused q/k/v, out, MLP) as a TE FP8 GEMM with delayed scaling.
`--preset gpt-1b --seq-len 2048 --batch-size 8` is the size where FP8 is meant to pay. Writes
fp8_train.json, fp8_train.md and fp8_train.png to --out.
"""

from __future__ import annotations

import json
import os

import numpy as np

import models
from train import flags
from models import plans
from benchmarks import common, report
from train import loop, metrics


SMALL = {"n_layer": 4, "n_head": 4, "d_model": 512, "seq_len": 512}  # --preset tiny: the fields not given


def config(backend: str, a) -> models.GPTConfig:
  given = {"n_layer": a.n_layer, "n_head": a.n_head, "d_model": a.d_model, "seq_len": a.seq_len}
  if a.preset == "tiny":
    given = {k: SMALL[k] if v is None else v for k, v in given.items()}
    given["n_kv_head"] = given["n_head"]
  return models.preset(a.preset, backend=backend, dtype="bfloat16", **given)


def run(backend: str, a) -> list[dict]:
  path = os.path.join(a.out, f"fp8_train_{backend}.jsonl")
  if os.path.exists(path):
    os.remove(path)
  model = config(backend, a)
  summary = loop.run(loop.TrainConfig(model=model, steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=0,
                                      log_every=a.log_every, eval_every=0, sample_tokens=0, metrics=path,
                                      progress=False))
  with open(path) as f:
    records = [metrics.loads(line) for line in f if '"step"' in line]
  print(backend, json.dumps(summary), flush=True)
  dtype = "fp8" if backend == "te-fp8" else "bf16"
  return [{"backend": backend, "dtype": dtype, "status": "ok", "step": r["step"], "loss": r["loss"]}
          for r in records if r.get("loss") is not None]


def main(argv=None) -> None:
  p = flags.Parser(prog="python -m benchmarks.fp8_train", description=flags.description(__doc__), formatter_class=flags.Help)
  one = flags.int_at_least(1)
  p.add_argument("--preset", choices=list(models.PRESETS), default="tiny",
                 help=f"model shape (tiny: widened to {SMALL} unless given)")
  p.add_argument("--baseline", choices=["te", "cudnn"], default="te", help="the bf16 run te-fp8 is compared with")
  p.add_argument("--steps", type=one, default=300, help="optimizer steps of each run")
  p.add_argument("--n-layer", type=one, help="transformer blocks; default: the preset's")
  p.add_argument("--n-head", type=one, help="query heads; default: the preset's")
  p.add_argument("--d-model", type=one, help="model width; default: the preset's")
  p.add_argument("--seq-len", type=one, help="context length; default: the preset's")
  p.add_argument("--batch-size", type=one, default=16, help="global batch")
  p.add_argument("--lr", type=flags.positive_float, default=1e-3, help="peak learning rate")
  p.add_argument("--log-every", type=one, default=10, help="steps between the loss records compared")
  p.add_argument("--out", default="runs/benchmarks", help="output folder (published results: benchmarks/results/h200, written only when named here)")
  a = p.parse_args(argv)
  common.check_out(p, a.out)  # before any timing: rows that cannot be written are never timed
  report.require_plots()
  try:
    configs = {backend: config(backend, a) for backend in (a.baseline, "te-fp8")}
  except ValueError as e:  # a model the flags describe cannot be built
    p.error(str(e))
  common.refuse_unless_runnable(
      {("--baseline " if b == a.baseline else "") + b: plans.attention_plans(cfg, a.batch_size, cfg.seq_len)
       for b, cfg in configs.items()},
      "This benchmark trains the model with each of these kernels: run it where they both run")
  os.makedirs(a.out, exist_ok=True)
  rows = run(a.baseline, a) + run("te-fp8", a)
  bf16 = {r["step"]: r["loss"] for r in rows if r["backend"] == a.baseline}
  fp8 = {r["step"]: r["loss"] for r in rows if r["backend"] == "te-fp8"}
  steps = sorted(set(bf16) & set(fp8))
  diff = [abs(fp8[s] - bf16[s]) for s in steps]
  last = [s for s in steps if s > a.steps - 100]
  cfg = config("te-fp8", a)
  env = common.environment() | {"model": {"preset": a.preset} | cfg.architecture() | {"head_dim": cfg.head_dim},
                                "batch_size": a.batch_size, "lr": a.lr, "steps": a.steps, "baseline": a.baseline}
  stats = {f"final_loss_{a.baseline}": bf16[steps[-1]], "final_loss_te_fp8": fp8[steps[-1]],
           "max_abs_loss_diff": max(diff),
           "mean_abs_loss_diff_last_100_steps": float(np.mean([abs(fp8[s] - bf16[s]) for s in last]))}
  report.write_json(os.path.join(a.out, "fp8_train.json"), env | stats, rows)
  report.line_plot(os.path.join(a.out, "fp8_train.png"), rows, x="step", y="loss",
                   title=f"training loss: {a.baseline} (bf16) vs te-fp8, {a.preset}", logx=False)
  table = [{"step": s, a.baseline: bf16[s], "te-fp8": fp8[s], "diff": fp8[s] - bf16[s]} for s in steps
           if s % 50 == 0 or s == steps[-1]]
  md = (f"# te-fp8 vs {a.baseline} training loss\n\n{env}\n\n"
        + report.markdown_table(table, ["step", a.baseline, "te-fp8", "diff"])
        + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in stats.items()) + "\n\n![loss](fp8_train.png)\n")
  with open(os.path.join(a.out, "fp8_train.md"), "w") as f:
    f.write(md)
  print(md)


if __name__ == "__main__":
  main()
