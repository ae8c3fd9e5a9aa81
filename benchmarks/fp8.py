"""`python -m benchmarks.fp8`: what FP8 buys, per pass, for the core and the whole layer.

Core (default B2 T8192 N32 H128 causal): the bf16 cuDNN and TE cores against te-fp8's core
(per-tensor quantisation + cuDNN FP8 forward + bf16 backward), with current scaling (scales
from this call's amaxes) and delayed scaling (from an amax history, as the te-fp8 layer
runs it), and against the bare cuDNN FP8 kernels on already-quantised inputs with unit
scales, forward and backward separately, so the FP8 backward's cost is measured next to the
bf16 one the core uses. Each scaling's own work is timed alone too, against the time a
same-run device copy needs for the bytes that work must move at least (`vs_copy`).
Layer (default B4 T4096 d_model 4096 N32, causal): te vs te-fp8 (delayed and current
scaling) vs cudnn, forward and forward+backward, plus the four projection GEMMs alone in
bf16 and in FP8, which is where most of a layer's FLOPs are.

Every figure is a median of >= 20 calls after compilation and warm-up (benchmarks.common);
ratios are within this one run. Rates count the FLOPs the math needs (benchmarks.flops);
each row says which dense peak bounds it (FP8 rows may pass the bf16 matmul, not the FP8
peak). Writes fp8.json and fp8.md to --out.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

import attnlayers
from train import flags
from attnlayers.backends import _fp8_core, _fp8_delayed
from attnlayers.fp8 import FP8Meta, FP8Recipe, TEFp8DotGeneral
from attnlayers.nnx import MultiHeadAttention
from benchmarks import common, decode_report, flops, report

BF16 = jnp.bfloat16


def core_programs(B, T, N, H, causal):
  """name -> (pass, fn, args, flops, peak kind)."""
  kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, (B, T, N, H), BF16) for key in (kq, kk, kv, kd))  # (B, T, N, H)
  scale = H ** -0.5
  count = lambda pass_: flops.attention(B, T, T, N, H, causal=causal, pass_=pass_)
  out = {}
  amax = jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in (q, k, v)])
  history = jnp.zeros((3, 1024), jnp.float32).at[:, 0].set(amax)  # (3, L): a step later, as in training
  for name, backend, extra in (("cudnn", "cudnn", ()), ("te", "te", ()), ("te-fp8", "te-fp8", ()),
                               ("te-fp8 delayed", "te-fp8", (history,))):
    f = lambda q, k, v, *h, b=backend: attnlayers.attention(q, k, v, backend=b, is_causal=causal,
                                                            fp8_amax_history=h[0] if h else None)
    kind = "fp8" if backend == "te-fp8" else "bf16"
    out[f"{name} core"] = ("fwd", f, (q, k, v, *extra), count("fwd"), kind)
    out[f"{name} core "] = ("fwd+bwd", *common.forward_backward(f, (q, k, v, *extra)), count("fwd+bwd"), kind)
  n = q.size  # elements of each of q, k, v, O
  current = lambda q, k, v, o8: ([_fp8_core._quantize(x) for x in (q, k, v)], o8.astype(BF16) * 0.5)
  delayed = lambda q, k, v, h, o8: ([_fp8_delayed.quantize(x, s) for x, s in zip((q, k, v), _fp8_delayed.scales_from(h))],
                                    o8.astype(BF16) * 0.5)
  q8, k8, v8, do8 = (x.astype(_fp8_core.E4M3) for x in (q, k, v, do))
  # bytes: current reads q, k, v twice (amax, then quantise) and writes E4M3; delayed reads them once; both read
  # O in E4M3 and write it in bf16
  out["current scaling alone: amax, then quantise q, k, v; dequantise O"] = ("fwd", current, (q, k, v, q8), 0.0, "fp8",
                                                                             n * (3 * 5 + 3))
  out["delayed scaling alone: quantise q, k, v with their amax; dequantise O"] = (
      "fwd", delayed, (q, k, v, history, q8), 0.0, "fp8", n * (3 * 3 + 3))
  ones = (1.0, 1.0, 1.0)
  raw = lambda training: (lambda q8, k8, v8: _fp8_core.fp8_forward(
      q8, k8, v8, ones, 1.0, scale=scale, is_causal=causal, training=training)[0])
  out["fp8 kernel, inference fwd"] = ("fwd", raw(False), (q8, k8, v8), count("fwd"), "fp8")
  out["fp8 kernel, training fwd"] = ("fwd", raw(True), (q8, k8, v8), count("fwd"), "fp8")
  # backward kernels alone, from one forward's saved outputs and statistics
  o8, _, _, stats = jax.jit(lambda *a: _fp8_core.fp8_forward(*a, ones, 1.0, scale=scale, is_causal=causal,
                                                             training=True))(q8, k8, v8)
  o = o8.astype(BF16)
  out["fp8 kernel, bwd"] = ("bwd", lambda *a: _fp8_core.fp8_backward(*a, scale=scale, is_causal=causal),
                            (q8, k8, v8, o8, do8, stats), count("bwd"), "fp8")
  out["bf16 kernel, bwd (te-fp8's)"] = ("bwd", lambda *a: _fp8_core.bf16_backward(*a, scale=scale, is_causal=causal),
                                        (q, k, v, stats, o, do), count("bwd"), "bf16")
  return out


def layer_flops(B, T, D, N, causal, pass_):
  H = D // N
  return flops.attention(B, T, T, N, H, causal=causal, pass_=pass_) + flops.projections(B, T, D, N, N, H, pass_=pass_)


def layer_program(B, T, D, N, causal, backend, recipe=None):
  """(fn, args) of one nnx layer's forward, x (B, T, D) -> (B, T, D)."""
  x = jax.random.normal(jax.random.key(1), (B, T, D), BF16)
  layer = MultiHeadAttention(N, D, decode=False, backend=backend, is_causal=causal, dtype=BF16, fp8_recipe=recipe,
                             rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  return (lambda s, x: nnx.merge(graphdef, s)(x)), (state, x)


def projection_inputs(B, T, D):
  """Four inputs (4, B, T, D) and four kernels (4, D, D): four products XLA cannot merge into one."""
  xs = jax.random.normal(jax.random.key(3), (4, B, T, D), BF16)
  return xs, jax.random.normal(jax.random.key(2), (4, D, D), BF16) / D**0.5


def bf16_projections(xs, w):
  return jnp.stack([jnp.einsum("btd,de->bte", xs[i], w[i]) for i in range(4)])  # (4, B, T, D)


def layer_programs(B, T, D, N, causal):
  """name -> (pass, fn, args, flops, peak kind)."""
  out = {}
  for name, backend, recipe in (("te", "te", None), ("cudnn", "cudnn", None), ("te-fp8 delayed", "te-fp8", FP8Recipe()),
                                ("te-fp8 current", "te-fp8", FP8Recipe(kind="current"))):
    f, args = layer_program(B, T, D, N, causal, backend, recipe)
    kind = "fp8" if backend == "te-fp8" else "bf16"
    out[f"{name} layer"] = ("fwd", f, args, layer_flops(B, T, D, N, causal, "fwd"), kind)
    out[f"{name} layer "] = ("fwd+bwd", *common.forward_backward(f, args), layer_flops(B, T, D, N, causal, "fwd+bwd"),
                             kind)
  xs, w = projection_inputs(B, T, D)
  graphdef, meta = nnx.split(nnx.List([TEFp8DotGeneral(FP8Recipe()) for _ in range(4)]), FP8Meta)

  def fp8_gemms(xs, w, meta):
    dots = nnx.merge(graphdef, meta)
    return jnp.stack([dots[i](xs[i], w[i], (((2,), (0,)), ((), ()))) for i in range(4)])
  proj = flops.projections(B, T, D, N, N, D // N, pass_="fwd+bwd")
  out["4 projections bf16"] = ("fwd+bwd", *common.forward_backward(bf16_projections, (xs, w)), proj, "bf16")
  out["4 projections fp8 (TE, delayed)"] = ("fwd+bwd", *common.forward_backward(fp8_gemms, (xs, w, meta)), proj, "fp8")
  return out


FLOPS_NOTE = ("`tflops` counts the FLOPs the math needs (benchmarks.flops: attention 4·B·N·T·S·H forward, halved "
              "when causal, backward twice the forward; projections 2·M·K·N forward), a lower bound of what runs. "
              "`vs_matmul`: that rate over an 8192³ bf16 matmul timed in the same process. `peak`: the dense "
              "datasheet peak the row is checked against (a rate above it stops the benchmark); fp8 rows may pass "
              "the bf16 matmul. `copy_ms`: for the scaling rows, the time a device copy (x + 1 in place over 2 GiB, "
              "timed in the same process) needs to move the bytes that work must move at least; `vs_copy`: that "
              "time over the row's.")


def measure(programs, matmul, calls, warmup, copy_gbps) -> list[dict]:
  """Rows of programs {name: (pass, fn, args, flops, peak kind[, bytes it must move])}."""
  rows = []
  for name, (pass_, fn, args, count, kind, *nbytes) in programs.items():
    peak, peak_name = common.dense_peak(kind)
    row = {"name": name.strip(), "pass": pass_, "peak": peak_name}
    try:
      t = common.time_fn(jax.jit(fn), *args, warmup=warmup, calls=calls)
    except Exception as e:  # noqa: BLE001 - a failing program is a row with its message
      rows.append(row | {"status": "error", "reason": common.reason(e)})
      continue
    # None: memory-bound work, no FLOPs counted; a rate above the peak raises
    tflops = flops.check_rate(name.strip(), count, t.median_ms * 1e-3, peak, peak_name) / 1e12 if count else None
    rows.append(row | {"status": "ok", "median_ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms,
                       "calls": t.calls, "tflops": tflops, "vs_matmul": tflops and tflops / matmul})
    if nbytes:  # memory-bound: the least bytes it must move, and the time a device copy takes for them
      rows[-1] |= {"copy_ms": nbytes[0] / (copy_gbps * 1e9) * 1e3, "vs_copy": nbytes[0] / (t.median_ms * 1e-3) / 1e9 / copy_gbps}
  return rows


def ratio(rows, a, b, pass_):
  get = {(r["name"], r["pass"]): r.get("median_ms") for r in rows}
  ta, tb = get.get((a, pass_)), get.get((b, pass_))
  return tb / ta if ta and tb else None


def kernel_plans(core, layer) -> dict:
  """{label: plan} of the attention each core and layer program runs (causal, bf16; te-fp8 with its FP8 core)."""
  B, T, D, N = layer
  shapes = {f"--core {' '.join(map(str, core))}": tuple(core), f"--layer {' '.join(map(str, layer))}": (B, T, N, D // N)}
  plans = {}
  for where, shape in shapes.items():
    q = jax.ShapeDtypeStruct(shape, BF16)  # (B, T, N, H)
    plans |= {f"{b} at {where}": attnlayers.explain(b, q, q, q, is_causal=True) for b in ("cudnn", "te", "te-fp8")}
  return plans


def main(argv=None) -> None:
  p = flags.Parser(prog="python -m benchmarks.fp8", description=flags.description(__doc__), formatter_class=flags.Help)
  one = flags.int_at_least(1)
  p.add_argument("--core", nargs=4, type=one, default=[2, 8192, 32, 128], metavar=("B", "T", "N", "H"),
                 help="shape of the core rows, causal (te-fp8's FP8 core needs H 128, T a multiple of 128)")
  p.add_argument("--layer", nargs=4, type=one, default=[4, 4096, 4096, 32], metavar=("B", "T", "D", "N"),
                 help="shape of the layer rows: x (B, T, D), N heads of D / N features")
  p.add_argument("--calls", type=one, default=20, help="timed calls per row, after compilation and warm-up")
  p.add_argument("--warmup", type=flags.int_at_least(0), default=3, help="untimed calls per row after compilation")
  p.add_argument("--out", default="runs/benchmarks", help="output folder (published results: benchmarks/results/h200, written only when named here)")
  a = p.parse_args(argv)
  common.check_out(p, a.out)  # before any timing: rows that cannot be written are never timed
  D, N = a.layer[2:]
  if D % N:
    p.error(f"--layer B T D N: D ({D}) must be a multiple of N ({N}), the head dim being D / N")
  common.refuse_unless_runnable(kernel_plans(a.core, a.layer),
                                "This benchmark times each of these kernels itself: run it where they all run")
  env = common.environment() | {"matmul_bf16_tflops": common.matmul_tflops(), "matmul_n": common.yardstick_n(),
                                "copy_gb_per_s": decode_report.copy_gb_per_s(2**31)}
  print(env, flush=True)
  yardsticks = env["matmul_bf16_tflops"], a.calls, a.warmup, env["copy_gb_per_s"]
  rows = [r | {"level": "core"} for r in measure(core_programs(*a.core, causal=True), *yardsticks)]
  rows += [r | {"level": "layer"} for r in measure(layer_programs(*a.layer, causal=True), *yardsticks)]
  ratios = {
      "te-fp8 core fwd vs cudnn core fwd (current scaling)": ratio(rows, "te-fp8 core", "cudnn core", "fwd"),
      "te-fp8 delayed core fwd vs cudnn core fwd": ratio(rows, "te-fp8 delayed core", "cudnn core", "fwd"),
      "fp8 kernel (inference fwd) vs cudnn core fwd": ratio(rows, "fp8 kernel, inference fwd", "cudnn core", "fwd"),
      "fp8 kernel (training fwd) vs cudnn core fwd": ratio(rows, "fp8 kernel, training fwd", "cudnn core", "fwd"),
      "fp8 bwd kernel vs bf16 bwd kernel": ratio(rows, "fp8 kernel, bwd", "bf16 kernel, bwd (te-fp8's)", "bwd"),
      "te-fp8 core fwd+bwd vs cudnn core fwd+bwd (current scaling)": ratio(rows, "te-fp8 core", "cudnn core", "fwd+bwd"),
      "te-fp8 delayed core fwd+bwd vs cudnn core fwd+bwd": ratio(rows, "te-fp8 delayed core", "cudnn core", "fwd+bwd"),
      "te-fp8 delayed layer fwd+bwd vs te layer": ratio(rows, "te-fp8 delayed layer", "te layer", "fwd+bwd"),
      "te-fp8 current layer fwd+bwd vs te layer": ratio(rows, "te-fp8 current layer", "te layer", "fwd+bwd"),
      "fp8 projections vs bf16 projections (fwd+bwd)": ratio(rows, "4 projections fp8 (TE, delayed)",
                                                             "4 projections bf16", "fwd+bwd"),
  }
  env |= {"core_shape": dict(zip("BTNH", a.core)), "layer_shape": dict(zip("BTDN", a.layer)), "causal": True}
  os.makedirs(a.out, exist_ok=True)
  report.write_json(os.path.join(a.out, "fp8.json"), env | {"speedups": ratios}, rows)
  cols = ["level", "name", "pass", "status", "median_ms", "p10_ms", "p90_ms", "tflops", "vs_matmul", "peak", "copy_ms",
          "vs_copy"]
  speed = "\n".join(f"| {k} | {v:.3f}x |" if v else f"| {k} | n/a |" for k, v in ratios.items())
  md = (f"# FP8 benchmarks\n\n{env}\n\n{FLOPS_NOTE}\n\n" + report.markdown_table(rows, cols) +
        "\n\n| speed-up (same run, median time ratio) | |\n|---|---|\n" + speed + "\n")
  errors = [f"- {r['name']} ({r['pass']}): {r['reason']}" for r in rows if r["status"] != "ok"]
  md += "\n".join(errors) + ("\n" if errors else "")
  with open(os.path.join(a.out, "fp8.md"), "w") as f:
    f.write(md)
  print(md)


if __name__ == "__main__":
  main()
