"""`python -m benchmarks.layer`: every attention backend per call, the codelab's sweeps as a tool.

Sections (`--sections`): default (B4 T128 N8 H64: naive f32, xla f32/bf16, cudnn, te, te-fp8
with max |difference| to naive f32), seq (T = 64 ... 16384), batch (B = 1 ... 16 at T=256
and T=4096), heads (N=32 with K = 32, 8, 1 and KV-cache bytes per token), headdim (H = 32,
64, 128, 256: who accepts what, and why not), segments (packed documents) and window (causal
sliding windows), each against a baseline timed in the same run (benchmarks.packing; not in
the default list). Each for the forward and forward+backward pass, and (`--levels`) for the
bare core (attnlayers.attention) and the whole nnx layer (projections + core).

Every row: median/p10/p90 ms of >= 20 timed calls after compilation and warm-up (one
helper, benchmarks.common), TFLOP/s by benchmarks.flops' convention (the FLOPs the math
needs: 4 B N T S H forward, halved for causal, x3 for fwd+bwd; plus the projections for
the layer; a lower bound of what any backend executes), the fraction of an 8192^3 bf16
matmul timed in the same run, the compiled program's memory (arguments + outputs + temporaries),
and a status: ok, unavailable (every reason), skipped (why), or error (the message).
Writes layer.json, layer.csv, layer.md and PNG plots to --out. `--quick` is a CPU-sized
subset.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

import attnlayers
from train import flags
from attnlayers.fp8 import FP8Recipe
from attnlayers.nnx import MultiHeadAttention
from benchmarks import common, flops, packing, report, wrapper

BACKEND_DTYPES = [("naive", "bfloat16"), ("xla", "bfloat16"), ("cudnn", "bfloat16"), ("te", "bfloat16"),
                  ("te-fp8", "bfloat16"), ("splash", "bfloat16")]
# The kernels called directly, without attnlayers around them: the yardstick for the wrapper's cost.
RAW = {f"{name}-raw": (name, kernel) for name, kernel in wrapper.RAW.items()}
NAIVE_LIMIT_BYTES = 16 * 2**30  # naive materialises (B, N, T, S) float32 scores; larger rows are skipped


@dataclasses.dataclass(frozen=True)
class Case:
  section: str
  backend: str
  dtype: str
  B: int
  T: int
  N: int
  K: int
  H: int
  causal: bool
  pass_: str  # "fwd" or "fwd+bwd"
  level: str = "core"  # "core" (attnlayers.attention) or "layer" (projections + core)
  segments: int | None = None  # equal-length documents per row, passed as segment_ids; None: no segment ids
  window: int | None = None  # left of a causal sliding window, window=(left, 0); None: no window

  def __post_init__(self):
    if self.window is not None and not self.causal:
      raise ValueError(f"the benchmarked windows are causal, window=(left, 0) with is_causal=True; got {self}")

  @property
  def sliding_window(self) -> tuple[int, int] | None:
    """The window as attnlayers takes it: (left, 0) with is_causal=True."""
    return None if self.window is None else (self.window, 0)

  def flops(self) -> float:
    """The FLOPs the math needs (benchmarks.flops): the core, plus the layer's four projections."""
    if self.segments is not None:
      total = flops.attention_segments(self.B, self.T, self.N, self.H, documents=self.segments, causal=self.causal,
                                       pass_=self.pass_)
    elif self.window is not None:
      total = flops.attention_window(self.B, self.T, self.N, self.H, left=self.window, pass_=self.pass_)
    else:
      total = flops.attention(self.B, self.T, self.T, self.N, self.H, causal=self.causal, pass_=self.pass_)
    if self.level == "layer":
      total += flops.projections(self.B, self.T, self.N * self.H, self.N, self.K, self.H, pass_=self.pass_)
    return total

  @property
  def peak_kind(self) -> str:
    """Which dense peak bounds the row's rate: te-fp8 runs FP8 products."""
    return "fp8" if self.backend == "te-fp8" else "bf16"


def plan(quick: bool, sections: list[str], seqs: list[int] | None = None, batches: list[int] | None = None,
         levels: tuple[str, ...] = ("core", "layer")) -> list[Case]:
  passes = ("fwd", "fwd+bwd")
  seqs = seqs or ([64, 128, 256] if quick else [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
  batches = batches or ([1, 2] if quick else [1, 2, 4, 8, 16])
  big = dict(N=4, K=4, H=32) if quick else dict(N=16, K=16, H=128)
  cases = []
  for level in levels:
    if "default" in sections:
      for backend, dtype in [("naive", "float32"), ("xla", "float32"), ("xla", "bfloat16"), ("cudnn", "bfloat16"),
                             ("te", "bfloat16"), ("te-fp8", "bfloat16")]:
        cases += [Case("default", backend, dtype, 4, 128, 8, 8, 64, False, p, level) for p in passes]
    if "seq" in sections:
      backends = BACKEND_DTYPES + ([(raw, "bfloat16") for raw in RAW] if level == "core" else [])
      cases += [Case("seq", b, d, 2, t, causal=c, pass_=p, level=level, **big) for t in seqs for c in (False, True)
                for b, d in backends for p in passes]
    if "batch" in sections:
      for t in ([64, 128] if quick else [256, 4096]):
        cases += [Case(f"batch-T{t}", b, d, bs, t, causal=c, pass_=p, level=level, **big) for bs in batches
                  for c in (False, True) for b, d in BACKEND_DTYPES for p in passes]
    if "heads" in sections:
      N, T, H = (8, 128, 32) if quick else (32, 4096, 128)
      cases += [Case("heads", b, d, 2, T, N, k, H, True, p, level) for k in (N, N // 4, 1) for b, d in BACKEND_DTYPES
                for p in passes]
    if "headdim" in sections:
      T = 128 if quick else 1024
      cases += [Case("headdim", b, d, 2, T, 8, 8, h, True, "fwd", level) for h in (32, 64, 128, 256)
                for b, d in BACKEND_DTYPES]
    for section in (s for s in packing.SECTIONS if s in sections):
      cases += [Case(section, b, d, pass_=p, level=level, **shape) for shape in packing.sweep(section, quick)
                for b, d in BACKEND_DTYPES for p in passes]
  return cases


def _inputs(c: Case):
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (c.B, c.T, c.N, c.H)).astype(c.dtype)  # (B, T, N, H)
  k = jax.random.normal(kk, (c.B, c.T, c.K, c.H)).astype(c.dtype)  # (B, S, K, H)
  v = jax.random.normal(kv, (c.B, c.T, c.K, c.H)).astype(c.dtype)
  return q, k, v


def _call_options(c: Case, segment_ids=None) -> dict:
  """The case's segment_ids (an array, or a jax.ShapeDtypeStruct for explain) and window, where it has them."""
  return ({} if c.segments is None else {"segment_ids": segment_ids, "max_segments": c.segments}) | \
      ({} if c.window is None else {"window": c.sliding_window})


def _program(c: Case):
  """(function, args) timing the case; segment ids are arguments, not differentiated."""
  data = () if c.segments is None else (packing.segment_ids(c.B, c.T, c.segments),)
  if c.backend in RAW:
    raw = RAW[c.backend][1]
    def f(q, k, v):
      return raw(q, k, v, c.causal)
    args = _inputs(c)
  elif c.level == "core":
    def f(q, k, v, segment_ids=None):
      return attnlayers.attention(q, k, v, backend=c.backend, is_causal=c.causal, **_call_options(c, segment_ids))
    args = _inputs(c)
  else:
    layer = MultiHeadAttention(c.N, c.N * c.H, num_kv_heads=c.K, backend=c.backend, is_causal=c.causal,
                               sliding_window=c.sliding_window, decode=False, dtype=jnp.dtype(c.dtype),
                               rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), (c.B, c.T, c.N * c.H)).astype(c.dtype)
    def f(state, x, segment_ids=None):
      bound = {} if c.segments is None else {"max_segments": c.segments}
      return nnx.merge(graphdef, state)(x, segment_ids=segment_ids, **bound)
    args = (state, x)
  if c.pass_ == "fwd":
    return f, (*args, *data)
  return common.forward_backward(f, args, data)


def run_case(c: Case, matmul: float, calls: int, warmup: int, reference=None) -> dict:
  row = {k.rstrip("_"): v for k, v in dataclasses.asdict(c).items()
         if k not in packing.SECTIONS or k == c.section} | {"S": c.T}  # segments / window: in their own section
  if c.section == "heads":
    row["kv_cache_bytes_per_token"] = 2 * c.K * c.H * jnp.dtype(c.dtype).itemsize
  q = jax.ShapeDtypeStruct((c.B, c.T, c.N, c.H), jnp.dtype(c.dtype))
  kv = jax.ShapeDtypeStruct((c.B, c.T, c.K, c.H), jnp.dtype(c.dtype))
  backend = RAW[c.backend][0] if c.backend in RAW else c.backend  # a raw kernel needs what its backend needs
  ids = jax.ShapeDtypeStruct((c.B, c.T), jnp.int32)
  history = {}  # a te-fp8 layer (default recipe) scales its FP8 core from an amax history: explain() says so
  if c.level == "layer" and backend == "te-fp8":
    history = {"fp8_amax_history": jax.ShapeDtypeStruct((3, FP8Recipe().amax_history_len), jnp.float32)}
  explained = attnlayers.explain(backend, q, kv, kv, is_causal=c.causal, **_call_options(c, ids), **history)
  if not explained.ok:
    return row | {"status": "unavailable", "reason": "; ".join(explained.unmet[backend])}
  if explained.notes and c.backend not in RAW:
    row["note"] = "; ".join(explained.notes)  # e.g. te-fp8: whether its core ran in FP8, and if not why
  if c.backend == "naive" and c.B * c.N * c.T * c.T * 4 * (2 if c.pass_ == "fwd+bwd" else 1) > NAIVE_LIMIT_BYTES:
    what = "scores and their gradient" if c.pass_ == "fwd+bwd" else "scores"
    return row | {"status": "skipped", "reason": f"naive's (B, N, T, S) float32 {what} need more than "
                                                 f"{NAIVE_LIMIT_BYTES / 2**30:.0f} GiB"}
  try:
    fn, args = _program(c)
    jitted = jax.jit(fn)
    mem = jitted.lower(*args).compile().memory_analysis()
    t = common.time_fn(jitted, *args, warmup=warmup, calls=calls)
    if reference is not None and c.pass_ == "fwd" and not (c.backend == "naive" and c.dtype == "float32"):  # not itself
      out = jitted(*args).astype(jnp.float32)
      row["max_abs_diff_vs_naive_f32"] = float(jnp.abs(out - reference).max())
  except Exception as e:  # noqa: BLE001 - a failing case is a row with its message
    return row | {"status": "error", "reason": common.reason(e)}
  peak, peak_name = common.dense_peak(c.peak_kind)
  tflops = flops.check_rate(f"{c}", c.flops(), t.median_ms * 1e-3, peak, peak_name) / 1e12  # raises above peak
  memory = mem and mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
  return row | {"status": "ok", "median_ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms, "calls": t.calls,
                "tflops": tflops, "vs_matmul": tflops / matmul, "memory_gib": memory and memory / 2**30}


def _reference(c: Case):
  """naive float32 output of the default case, the yardstick for max |difference|."""
  f32 = dataclasses.replace(c, backend="naive", dtype="float32", pass_="fwd")
  fn, args = _program(f32)
  return jax.jit(fn)(*args).astype(jnp.float32)


FLOPS_NOTE = ("`tflops` counts the FLOPs the math needs (benchmarks.flops): attention 4·B·N·T·S·H forward, "
              "halved when causal, x3 forward+backward (no flash recomputation), plus the layer's projections. "
              "Every backend executes at least that, so it is a lower bound of the hardware's rate. `vs_matmul`: "
              "that rate over a bf16 matmul of size `matmul_n`³ timed in the same process; te-fp8 rows may exceed 1 (FP8).")
VS_XLA_NOTE = ("`vs_xla`: the xla row's median_ms over this row's, for the same case timed in the same process "
               "(above 1: faster than xla); empty where xla did not run that case.")
COLUMNS = ["section", "level", "backend", "dtype", "B", "T", "N", "K", "H", "causal", "pass", "status", "median_ms",
           "p10_ms", "p90_ms", "tflops", "vs_matmul", "memory_gib"]


def write(out: str, env: dict, rows: list[dict]) -> list[str]:
  os.makedirs(out, exist_ok=True)
  report.write_json(os.path.join(out, "layer.json"), env, rows)
  report.write_csv(os.path.join(out, "layer.csv"), rows)
  plots = []
  default = [r for r in rows if r["section"] == "default" and r["level"] == "core" and r["pass"] == "fwd"]
  if default:
    report.bar_plot(os.path.join(out, "layer_default.png"), default, y="median_ms",
                    title="B4 T128 N8 H64, forward, median ms")
    plots.append("layer_default.png")
  for section in dict.fromkeys(r["section"] for r in rows):
    x = {"seq": "T", "heads": "K"}.get(section, "B" if section.startswith("batch") else None)
    if x is None:
      continue
    for level in ("core", "layer"):
      sel = [r for r in rows if r["section"] == section and r["level"] == level and r["causal"] and r["pass"] == "fwd+bwd"]
      for y in ("median_ms", "tflops") if sel else ():
        name = f"layer_{section}_{y}.png" if level == "core" else f"layer_{section}_{level}_{y}.png"
        report.line_plot(os.path.join(out, name), sel, x=x, y=y, title=f"{section} ({level}), causal, fwd+bwd: {y}")
        plots.append(name)
  plots += packing.plots(out, rows)
  vs_xla = f" {VS_XLA_NOTE}" if any("vs_xla" in r for r in rows) else ""
  md = [f"# Attention layer benchmarks\n\n{env}\n\n{FLOPS_NOTE}{vs_xla}\n"]
  for section in dict.fromkeys(r["section"] for r in rows):
    sel = [r for r in rows if r["section"] == section]
    cols = COLUMNS + (["max_abs_diff_vs_naive_f32"] if section == "default" else []) + \
        (["kv_cache_bytes_per_token"] if section == "heads" else []) + \
        (["vs_xla"] if any("vs_xla" in r for r in sel) else [])
    if section in packing.SECTIONS:
      md.append(f"## {section}\n\n{packing.NOTES[section]}\n\n"
                + report.markdown_table(packing.for_table(section, sel), packing.columns(section, cols))
                + f"\n\n{packing.targets(section, sel)}")
    else:
      md.append(f"## {section}\n\n" + report.markdown_table(sel, cols))
    reasons = sorted({f"- {r['backend']} ({r['status']}): {r['reason']}" for r in sel if r["status"] != "ok"})
    reasons += sorted({f"- {r['backend']} H{r['H']} T{r['T']}: {r['note']}" for r in sel if r.get("note")})
    if reasons:
      md.append("\n".join(reasons))
  overhead = wrapper_overhead(rows)
  if overhead:
    md.append("## attnlayers.attention vs the raw kernel (median ms ratio; 1.00 = no cost)\n\n"
              + report.markdown_table(overhead, ["backend", "T", "causal", "pass", "ours_ms", "raw_ms", "ratio"]))
  md += [f"![{p}]({p})" for p in plots]
  with open(os.path.join(out, "layer.md"), "w") as f:
    f.write("\n\n".join(md) + "\n")
  return plots


def add_vs_xla(rows: list[dict]) -> list[dict]:
  """Sets vs_xla (the xla row's median_ms over this row's) on every ok row of another backend whose case has an ok
  xla row in `rows`, one run's rows: a ratio within one process."""
  key = lambda r: tuple(r.get(k) for k in ("section", "level", "dtype", "B", "T", "S", "N", "K", "H", "causal", "pass",
                                           *packing.SECTIONS))
  xla = {key(r): r["median_ms"] for r in rows if r["backend"] == "xla" and r["status"] == "ok"}
  for r in rows:
    if r["backend"] != "xla" and r["status"] == "ok" and key(r) in xla:
      r["vs_xla"] = xla[key(r)] / r["median_ms"]
  return rows


def wrapper_overhead(rows: list[dict]) -> list[dict]:
  """Same-run ratio of our core to the kernel called directly, per seq row pair that both ran."""
  key = lambda r: (r["T"], r["causal"], r["pass"])
  out = []
  for raw, (backend, _) in RAW.items():
    ours = {key(r): r for r in rows if r["section"] == "seq" and r["level"] == "core" and r["backend"] == backend
            and r["status"] == "ok"}
    for r in rows:
      if r["section"] == "seq" and r["backend"] == raw and r["status"] == "ok" and key(r) in ours:
        o = ours[key(r)]
        out.append({"backend": backend, "T": r["T"], "causal": r["causal"], "pass": r["pass"],
                    "ours_ms": o["median_ms"], "raw_ms": r["median_ms"], "ratio": o["median_ms"] / r["median_ms"]})
  return out


def _results(parser, path: str) -> dict:
  """The layer.json at `path` (python -m benchmarks.layer wrote it), or exit 2 (parser.error) naming the file."""
  try:
    with open(path, encoding="utf-8") as f:
      run = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    parser.error(f"--merge: {path} is not a layer.json this benchmark wrote: it cannot be read as JSON "
                 f"({getattr(e, 'strerror', None) or e})")
  env = run.get("environment") if isinstance(run, dict) else None
  if not (isinstance(env, dict) and "matmul_bf16_tflops" in env and isinstance(run.get("rows"), list)):
    parser.error(f"--merge: {path} is not a layer.json this benchmark wrote: it has no \"environment\" with "
                 "matmul_bf16_tflops and no \"rows\" list; give the layer.json files of earlier runs")
  return run


def main(argv=None) -> None:
  p = flags.Parser(prog="python -m benchmarks.layer", description=flags.description(__doc__))
  one = flags.int_at_least(1)
  p.add_argument("--quick", action="store_true", help="a CPU-sized subset (what CI runs)")
  p.add_argument("--sections", nargs="+",
                 choices=["default", "seq", "batch", "heads", "headdim", *packing.SECTIONS],
                 help=f"default: all but {' and '.join(packing.SECTIONS)} (benchmarks.packing: packed documents, "
                      "causal sliding windows; each row's ratio is to a baseline timed in the same run)")
  p.add_argument("--seqs", type=one, nargs="+",
                 help="T values of the seq section (default 64 ... 16384)")
  p.add_argument("--batches", type=one, nargs="+",
                 help="B values of the batch sections (default 1 ... 16)")
  p.add_argument("--levels", nargs="+", choices=["core", "layer"],
                 help="core: attnlayers.attention; layer: the nnx layer, projections + core (default: both)")
  p.add_argument("--calls", type=one, help="timed calls per row (default 20; 3 with --quick)")
  p.add_argument("--backends", nargs="+", choices=[b for b, _ in BACKEND_DTYPES] + list(RAW),
                 help="only these backends' rows (default: every one)")
  p.add_argument("--out", default="runs/benchmarks", help="output folder (published results: benchmarks/results/h200, written only when named here)")
  p.add_argument("--merge", nargs="+", metavar="LAYER_JSON",
                 help="times nothing: writes one report from earlier runs' layer.json (e.g. one per --sections)")
  a = p.parse_args(argv)
  common.check_out(p, a.out)  # before any timing: rows that cannot be written are never timed
  report.require_plots()
  timing = {"--quick": a.quick, "--sections": a.sections, "--seqs": a.seqs, "--batches": a.batches,
            "--levels": a.levels, "--calls": a.calls, "--backends": a.backends}
  if a.merge and (given := [flag for flag, v in timing.items() if v]):  # merge times nothing: it would drop them
    p.error(f"--merge times nothing and writes every row of its files: {', '.join(given)} would be ignored")
  a.sections = a.sections or ["default", "seq", "batch", "heads", "headdim"]
  a.levels = a.levels or ["core", "layer"]
  for flag, values, section in (("--seqs", a.seqs, "seq"), ("--batches", a.batches, "batch")):
    if values and section not in a.sections:
      p.error(f"{flag} sets the {section} section's points; --sections {' '.join(a.sections)} has no {section}")
  missing = [path for path in a.merge or [] if not os.path.isfile(path)]
  if missing:
    folders = [path for path in missing if os.path.isdir(path)]
    absent = [path for path in missing if path not in folders]
    p.error("--merge: " + "; ".join([f"no such file: {', '.join(absent)}"] * bool(absent) +
                                    [f"{', '.join(folders)}: a folder; give the layer.json files in it"] * bool(folders)))
  seen = {}
  for path in a.merge or []:
    if (first := seen.setdefault(os.path.realpath(path), path)) is not path:
      p.error(f"--merge: {first} and {path} are one file: its rows would be merged twice; give each run's "
              "layer.json once")
  if a.merge:
    runs = [_results(p, path) for path in a.merge]  # every file read before anything is written
    matmuls = [r["environment"]["matmul_bf16_tflops"] for r in runs]  # a merged run's is a list already
    env = runs[0]["environment"] | {"matmul_bf16_tflops": [x for m in matmuls for x in (m if isinstance(m, list) else [m])],
                                    "note": "rows from several processes; each row's vs_matmul uses its own process's matmul"}
    plots = write(a.out, env, [row for r in runs for row in r["rows"]])
    print(f"merged {len(a.merge)} runs; wrote layer.json, layer.csv, layer.md and {len(plots)} plots to {a.out}")
    return
  calls, warmup = (a.calls or (3 if a.quick else 20)), (1 if a.quick else 3)
  matmul_n = 1024 if a.quick else common.yardstick_n()
  matmul = common.matmul_tflops(n=matmul_n, calls=3 if a.quick else 20)
  env = common.environment() | {"matmul_bf16_tflops": matmul, "matmul_n": matmul_n}
  cases = [c for c in plan(a.quick, a.sections, a.seqs, a.batches, tuple(a.levels))
           if a.backends is None or c.backend in a.backends]
  if not cases:
    p.error(f"no rows: --sections {' '.join(a.sections)} has no row of --backends {' '.join(a.backends)}")
  rows, reference = [], {}
  for c in tqdm(cases, unit="row"):
    ref = None
    if c.section == "default":
      key = (c.level,)
      reference[key] = reference[key] if key in reference else _reference(c)
      ref = reference[key]
    rows.append(run_case(c, matmul, calls, warmup, ref))
  plots = write(a.out, env, add_vs_xla(packing.add_ratios(rows)))
  counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "unavailable", "skipped", "error")}
  print(f"{len(rows)} rows {counts}; wrote layer.json, layer.csv, layer.md and {len(plots)} plots to {a.out}")


if __name__ == "__main__":
  main()
