"""`python -m benchmarks.decode`: GPT decoding with a KV cache per attention backend, MHA vs GQA vs MQA.

Decoding one token reads every weight and the whole KV cache, so at small batch a step is
bound by memory traffic; fewer key/value heads (K) shrink the cache that every step reads.
This measures that, with models.generate.Decoder (random gpt2-small weights, greedy, no stop
token so every step runs), for each point (backend, K, batch B, context = prompt tokens):
  prefill_ms           one compiled prefill call of the whole prompt (its first token included);
  decode_ms_per_step   one compiled decode call of --steps steps, divided by --steps;
  tokens_per_s         B / decode time per step;
  kv_cache_mib, bytes per step, gb_per_s, frac_copy_bw   by benchmarks.decode_report's convention,
                       against a device memory copy (HBM on a GPU) timed at the start and the end of the
                       same run (the faster); frac_copy_bw is left out, saying why, where it would pass 1
                       (bytes served from a nearer cache: small models on a CPU).
The cache holds context + --steps positions. Time to first token (`ttft` rows) is prefill_ms
for a --ttft-context (1024) token prompt at batch 1 per backend. Before timing, attnlayers.explain is asked
whether the backend can run a decode step (T=1) and the prefill chunk; a backend that
cannot is a row with every reason, as is a point too large for the device (estimated) or
one that fails. Each timed call starts from the same cache position: the cache index is
rewound between calls (what a call wrote is overwritten by the next), so no cache is copied.

Default sweep: backends cudnn, xla, te, te-fp8, naive; K = 12 (MHA), 4 (GQA), 1 (MQA);
B = 1, 8, 32, 64, 128, 256; contexts 512 (gpt2-small, seq_len 1024) and 2048, 8192 (the same
shapes with seq_len 8192, the long-context variant; 8192 is cut to 8192 - steps); 64 steps;
5 timed calls after one warm-up. That is 5 TTFT points and 270 sweep points, each compiling
its own prefill and decode programs: far more than one device command, so
benchmarks/h200.sh runs a subset under --budget-s. Points run per backend (in --backends order), then context,
batch, K, so --budget-s cuts whole tails; every point not run is a row saying so.
`--quick`: the tiny preset (n_head 4; K 4 and 1), naive, xla and cudnn (which says why it
cannot run on a CPU), B 1 and 4, contexts 32 and 128 (128 on a seq_len-256 variant), 8 steps,
TTFT at 128 tokens; what CI runs on the CPU.
Writes decode.json, decode.csv, decode.md and PNG plots to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attnlayers
from train import flags
import models
from benchmarks import common, decode_report, report, trace
from models import compiler, generate

FP8_CORE = "fp8-or-bf16"  # te-fp8 points: FP8 core where the call qualifies, else bf16 (as benchmarks.train)
FULL = dict(preset="gpt2-small", long_seq_len=8192, backends=["cudnn", "xla", "te", "te-fp8", "naive"],
            kv_heads=[12, 4, 1], batches=[1, 8, 64, 256], contexts=[512, 2048, 8192], steps=64, calls=5,
            ttft_context=1024, copy_bytes=2**32, ratio_at=(64, 2048), batch1_context=1536, xla_options=["decode"])
QUICK = dict(preset="tiny", long_seq_len=256, backends=["naive", "xla", "cudnn"], kv_heads=[4, 1], batches=[1, 4],
             contexts=[32, 128], steps=8, calls=3, ttft_context=128, copy_bytes=2**28, ratio_at=(4, 128),
             batch1_context=64, xla_options=["decode"])
# the decode targets on gpt2-small shapes (K = 12, 4, 1), each read from this run's rows by decode_report.target_lines
TARGETS = dict(kv_heads=[12, 4, 1], batch1_context=1536, batch1_ms=0.30, batch_at=(64, 2048),
               frac_copy_bw={12: 0.85, 4: 0.70, 1: 0.50}, gqa_over_mha=(4, 2.2), kernels=100)
FULL["targets"] = TARGETS
XLA_OPTIONS = {"decode": compiler.DECODE, "default": {},  # --xla-options: models.compiler.DECODE, XLA's own,
               "graphs": compiler.COMMAND_BUFFERS,  # the decode loop as CUDA graphs (models.compiler.COMMAND_BUFFERS),
               "gemm": compiler.COMMAND_BUFFERS | {k: v for k, v in compiler.GEMM.items()  # those with the trainer's
                                                   if k != "xla_gpu_dot_merger_threshold_mb"},  # GEMM options,
               # or XLA's own with no GEMM split over K: a split GEMM (more blocks for a few rows) sums its parts in
               # a kernel of its own, one more per GEMM that XLA splits
               "unsplit": {"xla_gpu_experimental_force_split_k": 1}}


@dataclasses.dataclass(frozen=True)
class Point:
  section: str  # "ttft" or "sweep"
  backend: str
  K: int
  batch: int
  context: int  # prompt tokens asked for
  options: str = "decode"  # the programs' XLA options: a key of XLA_OPTIONS


def plan(s: dict) -> list[Point]:
  """Time to first token for every backend first, then each backend's sweep (per XLA options), with batch 1 at
  batch1_context (the context of the batch-1 target) where the contexts leave it out."""
  points = [Point("ttft", b, s["kv_heads"][0], 1, s["ttft_context"]) for b in s["backends"]]
  contexts = [(c, s["batches"]) for c in s["contexts"]]
  if s["batch1_context"] not in s["contexts"] and 1 in s["batches"]:
    contexts = sorted(contexts + [(s["batch1_context"], [1])])
  return points + [Point("sweep", b, k, B, c, o) for o in s["xla_options"] for b in s["backends"]
                   for c, batches in contexts for B in batches for k in s["kv_heads"]]


class _Repeat:
  """A call for common.time_fn: step(state) -> (state, out), every time from the cache position `pos`.

  After each step the cache index is set back to `pos` (one dispatch, issued while the step
  runs and not waited for); what the step wrote is overwritten by the next, so no cache is copied.
  """

  def __init__(self, step, state: dict, pos: int):
    self.step, self.state, self.pos = step, state, pos
    paths, self.tree = jax.tree_util.tree_flatten_with_path(state["cache"])
    self.is_index = ["cache_index" in jax.tree_util.keystr(path) for path, _ in paths]

  def __call__(self):
    state, self.out = self.step(self.state)
    leaves = jax.tree_util.tree_leaves(state["cache"])
    new = iter(_fill([x for x, i in zip(leaves, self.is_index) if i], self.pos))
    cache = jax.tree_util.tree_unflatten(self.tree, [next(new) if i else x for x, i in zip(leaves, self.is_index)])
    self.state = state | {"cache": cache, "pos": np.full(np.shape(state["pos"]), self.pos, np.int64)}  # no wait
    return self.out


_fill = jax.jit(lambda xs, pos: [jnp.full_like(x, pos) for x in xs])


def _explain(backend: str, cfg, B: int, prompt_len: int, cache_len: int):
  """(unmet reasons or None, chosen backend, notes) for a decode step and the prefill chunk."""
  lens = jax.ShapeDtypeStruct((B,), jnp.int32)
  dt, K = jnp.dtype(cfg.dtype), cfg.n_kv_head or cfg.n_head
  extra = {"fp8_core": cfg.fp8_core} if backend == "te-fp8" else {}
  chosen, notes, unmet = {}, [], {}
  for what, T in (("decode step", 1), ("prefill", prompt_len)):
    q = jax.ShapeDtypeStruct((B, T, cfg.n_head, cfg.head_dim), dt)  # (B, T, N, H)
    kv = jax.ShapeDtypeStruct((B, cache_len, K, cfg.head_dim), dt)  # (B, S, K, H): the whole cache
    p = attnlayers.explain(backend, q, kv, kv, is_causal=True, causal_alignment="bottom-right",
                           query_seq_lengths=lens, key_value_seq_lengths=lens, **extra)
    for r in (r for rs in p.unmet.values() for r in rs) if not p.ok else ():
      unmet.setdefault(r, []).append(what)
    chosen[what] = p.chosen
    notes += [f"{what}: {n}" for n in p.notes]
  if unmet:  # a reason both calls share is said once
    return [r if len(whats) == 2 else f"{whats[0]}: {r}" for r, whats in unmet.items()], None, ()
  names = set(chosen.values())
  return None, names.pop() if len(names) == 1 else ", ".join(f"{w} {c}" for w, c in chosen.items()), notes


def run_point(p: Point, built: "_Models", s: dict, limit: int | None) -> dict:
  cfg, steps = built.config(p), s["steps"]
  prompt_len = min(p.context, cfg.seq_len - steps)  # the long-context variant's last context leaves room to decode
  cache_len = prompt_len + steps
  K, H, itemsize = cfg.n_kv_head or cfg.n_head, cfg.head_dim, jnp.dtype(cfg.dtype).itemsize
  name = s["preset"] + ("" if cfg.seq_len == models.PRESETS[s["preset"]].seq_len else f"@{cfg.seq_len}")
  row = {"section": p.section, "backend": p.backend, "xla_options": p.options, "model": name, "n_layer": cfg.n_layer, "N": cfg.n_head, "K": K,
         "H": H, "dtype": cfg.dtype, "batch": p.batch, "context": prompt_len, "cache_len": cache_len, "steps": steps,
         "kv_cache_bytes": decode_report.kv_cache(cfg.n_layer, p.batch, cache_len, K, H, itemsize)}
  row["kv_cache_mib"] = row["kv_cache_bytes"] / 2**20
  notes = [f"context {p.context} cut to {prompt_len} so that {steps} steps fit seq_len {cfg.seq_len}"] \
      if prompt_len != p.context else []
  unmet, chosen, how = _explain(p.backend, cfg, p.batch, prompt_len, cache_len)
  if unmet:
    return row | {"status": "unavailable", "reason": "; ".join(unmet)}
  row["chosen"] = chosen
  if notes + how:
    row["note"] = "; ".join(notes + how)
  need = prefill_peak(cfg, p.batch, prompt_len, cache_len, chosen)
  if limit and need > 0.9 * limit:
    return row | {"status": "skipped", "reason": f"needs about {need / 2**30:.0f} GiB (prefill logits, cache, "
                                                 f"scores); the device has {limit / 2**30:.0f} GiB"}
  try:
    return row | _measure(built.get(p), p, s, prompt_len, cache_len)
  except Exception as e:  # noqa: BLE001 - a failing point is a row with its message
    return row | {"status": "error", "reason": common.reason(e)}


def _measure(model, p: Point, s: dict, prompt_len: int, cache_len: int) -> dict:
  cfg, steps, B = model.cfg, s["steps"], p.batch
  backend = None if p.backend == "te-fp8" else p.backend  # a te-fp8 model is built as one (FP8 projections)
  decoder = generate.Decoder(model, batch=B, cache_len=cache_len, prompt_len=prompt_len,
                             sampling=generate.Sampling(temperature=0), stop_token=None, backend=backend,
                             compiler_options=XLA_OPTIONS[p.options])
  prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, prompt_len), dtype=np.int32)  # (B, P)
  lengths = np.full((B,), prompt_len, np.int32)
  timed = dict(warmup=1, calls=s["calls"])
  prefill = _Repeat(lambda st: decoder.prefill(st, prompts, lengths), decoder.init_state(), 0)
  tp = common.time_fn(prefill, **timed)
  state, first = decoder.prefill(prefill.state, prompts, lengths)

  def decode_steps(st):
    st, tokens, n_new = decoder.decode(st, first, steps)
    return st, (tokens, n_new)
  decode = _Repeat(decode_steps, state, prompt_len)
  td = common.time_fn(decode, **timed)
  graphs = bool(XLA_OPTIONS[p.options].get("xla_gpu_enable_command_buffer"))  # a trace sees each graph as one launch
  kernels = kernels_per_step(decode, steps) if s["kernel_counts"] and not graphs else None
  n_new = decode.out[1]
  if not np.all(np.asarray(n_new) == steps):
    raise RuntimeError(f"the decode call ran {np.asarray(n_new).tolist()} steps per row, not {steps}")
  K, H, itemsize = cfg.n_kv_head or cfg.n_head, cfg.head_dim, jnp.dtype(cfg.dtype).itemsize
  cache = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(decode.state["cache"])
              if "cache_index" not in jax.tree_util.keystr(path))
  if cache != decode_report.kv_cache(cfg.n_layer, decoder.rows, cache_len, K, H, itemsize):  # rows >= B (MIN_GPU_ROWS)
    raise RuntimeError(f"the decoder's cache holds {cache} bytes, not the formula's")
  params = decode_report.param_bytes(decoder.params, cfg)
  per_step = decode_report.step_bytes(params, cfg.n_layer, B, prompt_len, K, H, itemsize)
  step_ms = td.median_ms / steps
  gbps = per_step / (step_ms * 1e-3) / 1e9
  return {"status": "ok", "prefill_ms": tp.median_ms, "prefill_p10_ms": tp.p10_ms, "prefill_p90_ms": tp.p90_ms,
          "prefill_tokens_per_s": B * prompt_len / (tp.median_ms * 1e-3), "decode_ms_per_step": step_ms,
          "decode_p10_ms_per_step": td.p10_ms / steps, "decode_p90_ms_per_step": td.p90_ms / steps,
          "tokens_per_s": B / (step_ms * 1e-3), "param_bytes": params, "bytes_per_step": per_step,
          "gb_per_s": gbps, "calls": td.calls, "compile_s": decoder.compile_s, "kernels_per_step": kernels,
          "command_buffers": graphs, "decode_step": decoder.decode_step_ran()}


def kernels_per_step(call, steps: int) -> float | None:
  """GPU kernels (and device copies) the decode program ran per step, from a profiler trace of one more `call`
  of `steps` steps: its events of module jit__decode over `steps` (the loop's condition counted, as it runs each
  step). None where the trace holds no GPU kernel (a CPU). A program compiled with command buffers shows each CUDA
  graph as one launch, not the kernels inside it: its points are not counted (run_point). The traced call's time is
  not used."""
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      jax.block_until_ready(call())
    events = trace.load(folder)
  return count_kernels(events, steps)


def count_kernels(events: list[dict], steps: int) -> float | None:
  """The GPU kernel events of module jit__decode in a trace's `events`, over `steps`; None where there are none."""
  ours = [e for e in trace.gpu_kernels(events) if str(e.get("args", {}).get("hlo_module", "")).startswith("jit__decode")]
  return len(ours) / steps if ours else None


def memory_limit() -> int | None:
  """Bytes the device lets a process allocate; None where it does not say (the CPU)."""
  stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
  return stats and stats.get("bytes_limit")


def prefill_peak(cfg, B: int, prompt_len: int, cache_len: int, backend: str) -> int:
  """A rough floor of a point's device memory: the model in float32 and its cast, the cache, the prefill's
  (B, 1, V) float32 logits (last token only) and its widest activation (the MLP's (B, P, 4D), twice), and
  what the chosen backend(s) materialise: naive/xla the (B, N, P, S) float32 scores, cudnn the (B, 1, P, S)
  mask and bias of a bottom-right prefill chunk."""
  H, K, itemsize = cfg.head_dim, cfg.n_kv_head or cfg.n_head, jnp.dtype(cfg.dtype).itemsize
  params = 12 * cfg.n_layer * cfg.d_model**2 + (cfg.vocab_size + cfg.seq_len) * cfg.d_model
  scores = 4 * B * cfg.n_head * prompt_len * cache_len if "naive" in backend or "xla" in backend else 0
  scores += B * prompt_len * cache_len * (1 + itemsize) if "cudnn" in backend else 0
  activations = 2 * B * prompt_len * cfg.mlp_ratio * cfg.d_model * itemsize
  return (params * (4 + itemsize) + decode_report.kv_cache(cfg.n_layer, B, cache_len, K, H, itemsize)
          + 4 * B * cfg.vocab_size + activations + scores)


class _Models:
  """Random-weight models per (K, seq_len), built on first use; te-fp8 gets its own (FP8 projections)."""

  def __init__(self, s: dict):
    self.s, self.built = s, {}

  def config(self, p: Point) -> models.GPTConfig:
    base = models.PRESETS[self.s["preset"]]
    seq_len = base.seq_len if p.context + self.s["steps"] <= base.seq_len else self.s["long_seq_len"]
    fp8 = p.backend == "te-fp8"
    return models.preset(self.s["preset"], n_kv_head=p.K, seq_len=seq_len, backend="te-fp8" if fp8 else "xla",
                         fp8_core=FP8_CORE if fp8 else None)

  def get(self, p: Point) -> models.GPT:
    cfg = self.config(p)
    if cfg not in self.built:
      if any(c.backend != cfg.backend for c in self.built):
        self.built = {}  # the other kind's models are done with (points run backend by backend)
      self.built[cfg] = models.GPT(cfg, rngs=nnx.Rngs(0))
    return self.built[cfg]


def sweep(s: dict, deadline: float | None, copy_gbps: float) -> list[dict]:
  """Every planned point's row; none is started past `deadline` (time.perf_counter) less the last one's duration."""
  rows, done, built, limit, last = [], {}, _Models(s), memory_limit(), 0.0
  for p in plan(s):
    key = (p.backend, p.K, p.batch, p.context, p.options)
    if key in done:  # a ttft point that is also a sweep point: measured once
      rows.append(done[key] | {"section": p.section})
      continue
    if deadline is not None and time.perf_counter() + last > deadline:
      rows.append({"section": p.section, "backend": p.backend, "xla_options": p.options, "K": p.K, "batch": p.batch,
                   "context": p.context, "status": "skipped", "reason": "not run: the time of --budget-s was spent"})
      continue
    t = time.perf_counter()
    row = run_point(p, built, s, limit)
    decode_report.add_fractions([row], copy_gbps)  # against the start's copy until the end's is timed
    last = time.perf_counter() - t
    done[key] = row
    rows.append(row)
    shown = decode_report.COLUMNS + ["status"]
    print({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in row.items() if k in shown}, flush=True)
  return rows


def main(argv=None) -> None:
  p = flags.Parser(prog="python -m benchmarks.decode", description=flags.description(__doc__))
  p.add_argument("--quick", action="store_true", help="the tiny preset on a CPU-sized subset (what CI runs)")
  p.add_argument("--backends", nargs="+", choices=attnlayers.BACKENDS, help=f"default {' '.join(FULL['backends'])}")
  p.add_argument("--kv-heads", type=int, nargs="+", help="K values; each divides the preset's n_head (default 12 4 1)")
  p.add_argument("--batches", type=flags.int_at_least(1), nargs="+", help="default 1 8 32 64 128 256")
  p.add_argument("--contexts", type=flags.int_at_least(1), nargs="+", help="prompt tokens (default 512 2048 8192)")
  p.add_argument("--ttft-context", type=flags.int_at_least(1), help="prompt tokens of the time-to-first-token points (default 1024; "
                 "128 with --quick)")
  p.add_argument("--steps", type=flags.int_at_least(1), help="decode steps per timed call (default 64; 8 with --quick)")
  p.add_argument("--calls", type=flags.int_at_least(1), help="timed calls per program (default 5; 3 with --quick)")
  p.add_argument("--batch1-context", type=flags.int_at_least(1), help="prompt tokens of the batch-1 points added "
                 "beside --contexts (default 1536; 64 with --quick)")
  p.add_argument("--xla-options", nargs="+", choices=list(XLA_OPTIONS), help="the programs' XLA options, one sweep "
                 "each: decode (models.compiler.DECODE; the default), default (XLA's own), graphs (the decode loop as CUDA "
                 "graphs: models.compiler.COMMAND_BUFFERS), gemm (graphs with the trainer's GEMM options: cuBLASLt "
                 "epilogues, no Triton GEMM fusions) or unsplit (XLA's own with no GEMM split over K)")
  p.add_argument("--kernel-counts", action=argparse.BooleanOptionalAction, default=None,
                 help="count each point's GPU kernels per decode step from a profiler trace (default: on a GPU)")
  p.add_argument("--budget-s", type=flags.positive_float, help="seconds for the whole command: no point starts that would, at the "
                 "last point's duration, end past them; those not run are rows saying so, and every file is written")
  p.add_argument("--out", default="runs/benchmarks", help="output folder (published results: benchmarks/results/h200, written only when named here)")
  a = p.parse_args(argv)
  common.check_out(p, a.out)  # before any timing: rows that cannot be written are never timed
  report.require_plots()
  start = time.perf_counter()
  s = dict(QUICK if a.quick else FULL)
  s |= {k: v for k, v in vars(a).items() if k in s and v is not None}
  s["kernel_counts"] = jax.default_backend() == "gpu" if a.kernel_counts is None else a.kernel_counts
  n_head, longest = models.PRESETS[s["preset"]].n_head, s["long_seq_len"]
  if any(k < 1 or n_head % k for k in s["kv_heads"]):
    p.error(f"--kv-heads must divide {s['preset']}'s n_head ({n_head}); got {s['kv_heads']}")
  if not 1 <= s["steps"] < longest or any(not 1 <= c for c in s["contexts"] + s["batches"] + [s["ttft_context"]]):
    p.error(f"need 1 <= --steps < {longest} and --contexts, --batches, --ttft-context >= 1")
  if too_long := [c for c in s["contexts"] + [s["ttft_context"], s["batch1_context"]] if c > longest]:
    p.error(f"--contexts / --ttft-context {', '.join(map(str, too_long))}: the longest context this benchmark's "
            f"{s['preset']} variants hold is {longest} (a prompt there is cut to {longest} - --steps, leaving room "
            f"for the decode steps); give {longest} or less")
  copy_gbps = decode_report.copy_gb_per_s(s["copy_bytes"], calls=s["calls"] * 4)
  env = common.environment() | {"decode_min_rows": generate.rows_for(1), "copy_gb_per_s_start": copy_gbps, "copy_bytes": s["copy_bytes"], "preset": s["preset"],
                                "steps": s["steps"], "budget_s": a.budget_s,
                                "xla_options": {o: XLA_OPTIONS[o] for o in s["xla_options"]}}
  print(env, flush=True)
  rows = sweep(s, None if a.budget_s is None else start + a.budget_s, copy_gbps)
  env["copy_gb_per_s_end"] = decode_report.copy_gb_per_s(s["copy_bytes"], calls=s["calls"] * 4)
  env["copy_gb_per_s"] = max(copy_gbps, env["copy_gb_per_s_end"])  # the yardstick: the faster of the two
  decode_report.add_fractions(rows, env["copy_gb_per_s"])
  env["elapsed_s"] = time.perf_counter() - start
  plots = decode_report.write(a.out, env, rows, s)
  counts = {k: sum(r["status"] == k for r in rows) for k in ("ok", "unavailable", "skipped", "error")}
  print(f"{len(rows)} rows {counts} in {env['elapsed_s']:.0f} s; wrote decode.json, decode.csv, decode.md and "
        f"{len(plots)} plots to {a.out}")


if __name__ == "__main__":
  main()
