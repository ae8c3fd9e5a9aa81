"""The decode benchmark's numbers and files: the bytes convention, stated once; the same-run copy yardstick.

A decode step of a small model at modest batch is bound by memory traffic, not FLOPs: each
step reads every weight and the whole KV cache up to its position. benchmarks.decode
reports that traffic as a rate and as a fraction of a plain device memory copy (HBM on a
GPU) timed in the same process, the most a step could move per second. `write` lays the
rows out as decode.json, .csv, .md (the MHA/GQA/MQA table and same-run ratios) and plots.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from benchmarks import common, report

BYTES_NOTE = ("Bytes moved per decode step = the parameters as the decoder holds them (compute dtype), "
              "without the position table (a lookup reads B of its rows; an untied token table likewise), "
              "+ the KV cache read at the prompt's length: 2·n_layer·B·context·K·H·itemsize. A lower bound "
              "of the traffic: activations, the cache entries written, the rows a step adds past the prompt and "
              "the cache padding a kernel reads anyway are not counted. `gb_per_s` = those bytes over the "
              "measured time per step (1 GB = 1e9 bytes); `frac_copy_bw` = that over `copy_gb_per_s`, an "
              "elementwise x + 1 in place (no call allocates) over a `copy_bytes` float32 buffer timed at the start "
              "and at the end of the same process, the faster of the two (bytes = read + write); left out "
              "(`frac_copy_bw_omitted` says why) where it would pass 1: such a step's bytes came from a cache nearer "
              "than the memory the copy measures, so the copy bounds nothing there; a step whose bytes fit in a "
              "cache (a small model on a CPU) may read them from it at a fraction below 1 too. `kv_cache_mib`: the "
              "whole cache, 2·n_layer·B·cache_len·K·H·itemsize. B is the batch asked for; on a GPU a batch of 1 "
              "runs as `decode_min_rows` rows (models.generate.MIN_GPU_ROWS), whose extra traffic is not counted.")
COLUMNS = ["K", "backend", "xla_options", "batch", "context", "kv_cache_mib", "decode_ms_per_step", "tokens_per_s",
           "gb_per_s", "frac_copy_bw", "kernels_per_step", "decode_step", "prefill_ms", "model"]
KERNELS_NOTE = ("`kernels_per_step`: the GPU kernels and device copies of the decode program (module jit__decode) "
                "in a profiler trace of one more call, over its steps (the loop's condition included); empty for "
                "programs compiled with command buffers, whose trace shows each CUDA graph as one launch. "
                "`xla_options`: `decode` compiles with models.compiler.DECODE (XLA's own options), `default` with XLA's "
                "own options, `graphs` with command buffers (the loop as CUDA graphs), `gemm` with those and the "
                "trainer's GEMM options, `unsplit` with XLA's own and no GEMM split over K (no kernel summing a "
                "split GEMM's parts).")


def kv_cache(n_layer: int, B: int, length: int, K: int, H: int, itemsize: int) -> int:
  """Bytes of keys and values for `length` positions of B rows in every layer."""
  return 2 * n_layer * B * length * K * H * itemsize


def _lookup(path, cfg) -> bool:
  keys = jax.tree_util.keystr(path)
  return "'wpe'" in keys or ("'wte'" in keys and not cfg.tie_embeddings)


def param_bytes(params, cfg) -> int:
  """Bytes of the parameters a decode step reads in full: all but lookup tables (see BYTES_NOTE)."""
  return sum(x.size * x.dtype.itemsize for path, x in jax.tree_util.tree_leaves_with_path(params)
             if not _lookup(path, cfg))


def step_bytes(param_bytes: int, n_layer: int, B: int, context: int, K: int, H: int, itemsize: int) -> int:
  """Bytes one decode step moves by BYTES_NOTE's convention."""
  return param_bytes + kv_cache(n_layer, B, context, K, H, itemsize)


def copy_gb_per_s(nbytes: int, calls: int = 20) -> float:
  """GB/s of x <- x + 1 in place over an `nbytes` float32 buffer (read + write), as this process measures it now.

  In place: each call is given the last one's output (donated), so no call allocates. A new output per call is
  memory that, on a CPU, the OS maps and zeroes on first touch, which the copy would time instead of the copy.
  The buffer is large (benchmarks.decode: 4 GiB, --quick 256 MiB, past a CPU's last-level cache) and the copy is
  warmed up (5 calls) before it is timed, so that dispatch, first-touch and clock ramp-up do not count.
  """
  t = common.time_fn(_InPlace(nbytes // 4), warmup=5, calls=calls)
  return 2 * (nbytes // 4) * 4 / (t.median_ms * 1e-3) / 1e9


class _InPlace:
  """A call for common.time_fn: x <- x + 1 on one float32 buffer of n elements, which each call donates."""

  def __init__(self, n: int):
    self.x = jnp.zeros((n,), jnp.float32)

  def __call__(self):
    self.x = _add_one(self.x)
    return self.x


_add_one = jax.jit(lambda x: x + 1, donate_argnums=0)


def add_fractions(rows: list[dict], copy_gb_per_s: float) -> None:
  """Each measured row's frac_copy_bw, its gb_per_s over the same-run copy's, where that is at most 1; above 1 the
  step moved its bytes faster than the copy moves a buffer too large for any cache, so they came from a nearer
  cache, of which the copy says nothing: frac_copy_bw is None and frac_copy_bw_omitted says why (a "fraction"
  above 1 would claim a rate past the memory's)."""
  for r in rows:
    if "gb_per_s" not in r:
      continue
    r.pop("frac_copy_bw_omitted", None)
    frac = r["gb_per_s"] / copy_gb_per_s
    r["frac_copy_bw"] = frac if frac <= 1 else None
    if frac > 1:
      r["frac_copy_bw_omitted"] = (f"gb_per_s {r['gb_per_s']:.4g} passes the same-run copy's {copy_gb_per_s:.4g} "
                                   f"GB/s: the step's {r['bytes_per_step'] / 2**20:.3g} MiB came from a cache nearer "
                                   "than the memory the copy measures")


def omitted_line(rows: list[dict], env: dict) -> str:
  """The report's line on the rows add_fractions gave no frac_copy_bw; "" where there are none."""
  measured = [r for r in rows if "gb_per_s" in r]
  left = [r for r in measured if r.get("frac_copy_bw") is None]
  if not left:
    return ""
  return (f"`frac_copy_bw` is left out of {len(left)} of {len(measured)} measured rows: their gb_per_s (up to "
          f"{max(r['gb_per_s'] for r in left):.4g}) passes the copy's {env['copy_gb_per_s']:.4g} GB/s (x + 1 in "
          f"place over {env['copy_bytes'] / 2**20:.0f} MiB), so their bytes (at most "
          f"{max(r['bytes_per_step'] for r in left) / 2**20:.3g} MiB per step) came from a cache nearer than the "
          "memory the copy measures, and no fraction of that memory's bandwidth is given for them.")


def _ok(rows: list[dict]) -> dict:
  """The measured sweep rows by (backend, xla_options, K, batch, context)."""
  return {(r["backend"], r.get("xla_options", "decode"), r["K"], r["batch"], r["context"]): r for r in rows
          if r["status"] == "ok" and r["section"] == "sweep"}


def ratio_lines(rows: list[dict], at: tuple[int, int]) -> list[str]:
  """Same-run tokens/s of GQA and MQA over MHA per backend and XLA options at (batch, context), where both ran."""
  ok = {key[:3]: r for key, r in _ok(rows).items() if key[3:] == at}
  lines = []
  for (backend, options, k), r in sorted(ok.items(), key=lambda kv: (kv[0][:2], -kv[0][2])):
    mha = ok.get((backend, options, r["N"]))
    if k < r["N"] and mha:
      kind = "MQA" if k == 1 else "GQA"
      lines.append(f"- {backend} ({options}): {kind} (K={k}) / MHA (K={r['N']}) tokens/s at batch {at[0]}, context "
                   f"{at[1]}: **{r['tokens_per_s'] / mha['tokens_per_s']:.3g}x** ({r['tokens_per_s']:.4g} / "
                   f"{mha['tokens_per_s']:.4g})")
  return lines or [f"- GQA, MQA / MHA at batch {at[0]}, context {at[1]}: not in this run's results"]


def target_lines(rows: list[dict], targets: dict) -> list[str]:
  """Each target of `targets` (benchmarks.decode's TARGETS) against this run's rows, per backend and XLA options:
  the figure, the bound and met / not met; a target whose rows did not run says so."""
  ok, lines = _ok(rows), []
  for backend, options in sorted({key[:2] for key in ok}):
    at = lambda K, B, c: ok.get((backend, options, K, B, c))
    who = f"{backend} ({options})"
    B1, c1 = 1, targets["batch1_context"]
    for K in targets["kv_heads"]:
      r = at(K, B1, c1)
      lines.append(_met(f"{who} K={K}, batch 1, context {c1}: ms per token", r and r["decode_ms_per_step"],
                        "<=", targets["batch1_ms"]))
    B, c = targets["batch_at"]
    for K, least in targets["frac_copy_bw"].items():
      r = at(K, B, c)
      lines.append(_met(f"{who} K={K}, batch {B}, context {c}: fraction of the copy bandwidth",
                        r and r.get("frac_copy_bw"), ">=", least))
    K, least = targets["gqa_over_mha"]
    gqa, mha = at(K, B, c), at(max(targets["kv_heads"]), B, c)
    lines.append(_met(f"{who} K={K} / MHA tokens/s, batch {B}, context {c}",
                      gqa and mha and gqa["tokens_per_s"] / mha["tokens_per_s"], ">=", least))
    counts = [r["kernels_per_step"] for key, r in ok.items() if key[:2] == (backend, options)
              and r.get("kernels_per_step") is not None]
    if not counts and any(r.get("command_buffers") for key, r in ok.items() if key[:2] == (backend, options)):
      lines.append(f"- {who} kernels per decode step: not counted (command buffers: a trace shows each CUDA graph as "
                   f"one launch; the same program under --xla-options default is counted)")
    else:
      lines.append(_met(f"{who} kernels per decode step (the most of any point)", max(counts) if counts else None,
                        "<=", targets["kernels"]))
  return lines or ["- no measured sweep rows"]


def _met(what: str, figure, sense: str, bound: float) -> str:
  if figure is None:
    return f"- {what}: not measured in this run (target {sense} {bound:g})"
  met = figure <= bound if sense == "<=" else figure >= bound
  return f"- {what}: {figure:.4g} (target {sense} {bound:g}: {'met' if met else 'not met'})"


def write(out: str, env: dict, rows: list[dict], s: dict) -> list[str]:
  os.makedirs(out, exist_ok=True)
  report.write_json(os.path.join(out, "decode.json"), env, rows)
  report.write_csv(os.path.join(out, "decode.csv"), rows)
  ok = [r for r in rows if r["status"] == "ok" and r["section"] == "sweep"]
  several = len({r.get("xla_options") for r in ok}) > 1
  # report.line_plot draws one line per (backend, dtype): here per K, and per option set where a run compares several
  label = lambda r: r | {"dtype": f"K={r['K']}" + (f", {r.get('xla_options')}" if several else "")}
  plots = []
  for c in sorted({r["context"] for r in ok}):
    sel = [label(r) for r in ok if r["context"] == c]
    if len({r["batch"] for r in sel}) > 1:
      plots.append(f"decode_tokens_per_s_context{c}.png")
      report.line_plot(os.path.join(out, plots[-1]), sel, x="batch", y="tokens_per_s",
                       title=f"{s['preset']} decode, context {c}: tokens/s vs batch")
  for b in sorted({r["batch"] for r in ok}):
    sel = [label(r) for r in ok if r["batch"] == b]
    if len({r["context"] for r in sel if r.get("frac_copy_bw") is not None}) > 1:
      plots.append(f"decode_frac_copy_bw_batch{b}.png")
      report.line_plot(os.path.join(out, plots[-1]), sel, x="context", y="frac_copy_bw",
                       title=f"{s['preset']} decode, batch {b}: fraction of the same-run copy bandwidth")
  ttft = [r | {"ttft_ms": r.get("prefill_ms")} for r in rows if r["section"] == "ttft"]
  table = sorted(ok, key=lambda r: (r["backend"], r.get("xla_options", ""), r["context"], r["batch"], -r["K"]))
  reasons: dict[str, int] = {}
  for r in rows:
    if r["status"] != "ok":
      why = f"{r['backend']} ({r['status']}): {r['reason']}"
      reasons[why] = reasons.get(why, 0) + 1
  notes = sorted({f"- {r['backend']} K={r['K']} B={r['batch']} context {r['context']}: {r['note']}"
                  for r in rows if r.get("note")})
  md = [f"# Decode benchmarks\n\n{env}\n\nSame-run memory copy: **{env['copy_gb_per_s']:.4g} GB/s** "
        f"(x + 1 in place over {env['copy_bytes'] / 2**20:.0f} MiB; read + write; the faster of "
        f"{env.get('copy_gb_per_s_start', float('nan')):.4g} at the start and {env.get('copy_gb_per_s_end', float('nan')):.4g} "
        f"at the end of the run).\n\n{BYTES_NOTE}\n\n{KERNELS_NOTE}" + (f"\n\n{omitted}" if (omitted := omitted_line(rows, env)) else ""),
        f"## Time to first token (prompt {s['ttft_context']} tokens, batch 1, K={s['kv_heads'][0]}; prefill + first "
        "token)\n\n" + report.markdown_table(ttft, ["backend", "chosen", "model", "K", "batch", "context", "status",
                                                    "ttft_ms", "decode_ms_per_step"]),
        "## MHA / GQA / MQA\n\n" + "\n".join(ratio_lines(rows, s["ratio_at"])) + "\n\n"
        + report.markdown_table(table, [c for c in COLUMNS if any(r.get(c) is not None for r in table)])]
  if s.get("targets"):
    md.append("## Targets\n\n" + "\n".join(target_lines(rows, s["targets"])))
  if reasons:
    md.append("## Not measured\n\n" + "\n".join(f"- {n} point(s): {why}" for why, n in sorted(reasons.items())))
  if notes:
    md.append("## Notes\n\n" + "\n".join(notes))
  md += [f"![{p}]({p})" for p in plots]
  with open(os.path.join(out, "decode.md"), "w") as f:
    f.write("\n\n".join(md) + "\n")
  return plots
