"""`python -m benchmarks.summary DIR`: writes benchmarks/RESULTS.md from the JSON files in DIR.

It reads what benchmarks.layer, .train, .fp8, .fp8_train and .wrapper wrote there (no
timing), and lays out the headline tables next to the plots, with the versions and device.
"""

from __future__ import annotations

import json
import os
import re

from train import flags
from benchmarks import common, report


# the JSON files the page is made of, and the benchmark (python -m benchmarks.<name>) that writes each
REQUIRED = {"layer.json": "layer", "fp8.json": "fp8", "wrapper.json": "wrapper", "train.json": "train"}


def _load(directory: str, name: str) -> dict:
  with open(os.path.join(directory, name)) as f:
    return json.load(f)


def render(directory: str, rel: str, note: str | None = None) -> str:
  """The page; `rel` is `directory` as seen from the page's folder (for links and images)."""
  layer, fp8 = _load(directory, "layer.json"), _load(directory, "fp8.json")
  wrapper, train = _load(directory, "wrapper.json"), _load(directory, "train.json")
  env = layer["environment"]
  rows = layer["rows"]
  at_16k = lambda level: [r for r in rows if r["section"] == "seq" and r["level"] == level and r["causal"]
                          and r["T"] == 16384]
  cols = ["backend", "pass", "status", "median_ms", "tflops", "vs_matmul", "reason"]
  heads = [r for r in rows if r["section"] == "heads" and r["level"] == "core" and r["pass"] == "fwd+bwd"]
  speedups = "\n".join(f"| {k} | {v:.4g}x |" if v else f"| {k} | n/a |" for k, v in fp8["environment"]["speedups"].items())
  oom = "\n".join(f"- {r['backend']} T={r['seq_len']}: {r['reason']}" for r in train["rows"] if r["status"] != "ok")
  img = lambda name: f"![{name}]({rel}/{name})"
  over = [f"{r['section']} {r['level']} {r['backend']} T{r['T']} {r['pass']}" for r in rows
          if r["status"] == "ok" and r["backend"] != "te-fp8" and r["vs_matmul"] > 1]
  over += [f"fp8.md {r['name']} {r['pass']}" for r in fp8["rows"]
           if r["status"] == "ok" and r.get("peak") == "bf16" and (r.get("vs_matmul") or 0) > 1]
  above = ("No bf16 program ran above the same-run matmul's rate." if not over else
           "bf16 programs above the same-run matmul's rate (check their FLOP count): " + "; ".join(over) + ".")
  above += " FP8 rows (`peak` fp8) may: FP8 products run at up to twice bf16's dense peak."
  note = f"\n{note}\n" if note else ""
  calls = sorted({r["calls"] for r in rows + fp8["rows"] if r.get("calls")})  # per-call timings: layer, fp8
  calls = " or ".join(map(str, calls)) or "the recorded number of"
  decode = [n for n in ("decode.json", "decode-batch1/decode.json") if os.path.isfile(os.path.join(directory, n))]
  decode_calls = " or ".join(map(str, sorted({r["calls"] for n in decode for r in _load(directory, n)["rows"]
                                              if r.get("calls")}))) or "their recorded number of"
  default_levels = " and ".join(dict.fromkeys(r["level"] for r in rows if r["section"] == "default")) or "no level"
  return f"""# Benchmark results: one {env['device']}

Made with jax {env['jax']}, flax {env['flax']}, Python {env['python']} on {env['devices']} x {env['device']}
(cuDNN {env.get("cudnn", "not recorded")}, TransformerEngine {env.get("transformer_engine", "not recorded")}). Regenerate with
`bash benchmarks/h200.sh`; this page with `python -m benchmarks.summary {directory}`.
Every per-call time (layer, fp8) is the median of {calls} timed calls after compilation and warm-up;
the wrapper table's, the median over rounds of such medians; the decode sections', of {decode_calls} calls
(decode.json's `calls`); training rates, the median of the logged intervals after the first. Per-call
`tflops` count the FLOPs the math needs (`benchmarks/flops.py`: attention 4·B·N·T·S·H
forward, halved when causal, backward twice the forward; projections 2·M·K·N), a lower
bound of what each backend executes; `vs_matmul` is that rate over an 8192³ bf16 matmul
timed in the same process (each JSON file records its own). Training rows use nanoGPT's /
PaLM's MFU count instead (the full attention square even for causal), and their matmul is
timed by the benchmark's parent process after the runs. {above}
Full tables: [layer.md]({rel}/layer.md), [train.md]({rel}/train.md),
[fp8.md]({rel}/fp8.md), [fp8_train.md]({rel}/fp8_train.md), [wrapper.md]({rel}/wrapper.md);
raw data in the JSON and CSV files beside them.
{note}
## Per call: sequence length (B2 N16 H128; causal, forward+backward in the plots)

Core (`attnlayers.attention`):

{img("layer_seq_median_ms.png")} {img("layer_seq_tflops.png")}

Whole layer (nnx, projections + core, d_model 2048):

{img("layer_seq_layer_median_ms.png")} {img("layer_seq_layer_tflops.png")}

Core at T=16384, causal:

{report.markdown_table(at_16k("core"), cols)}

Layer at T=16384, causal:

{report.markdown_table(at_16k("layer"), cols)}

## Per call: batch size (N16 H128, causal, forward+backward)

{img("layer_batch-T256_median_ms.png")} {img("layer_batch-T4096_median_ms.png")}

## MHA / GQA / MQA (B2 T4096 N32 H128, causal, forward+backward)

{img("layer_heads_median_ms.png")}

{report.markdown_table(heads, ["backend", "N", "K", "T", "H", "median_ms", "kv_cache_bytes_per_token"])}

## Default shape (B4 T128 N8 H64): every backend ({default_levels})

{img("layer_default.png")}

The `default` table in [layer.md]({rel}/layer.md) gives each backend's max |difference| to naive float32.

## attnlayers.attention vs the kernel called directly

`same_hlo_ops`: our compiled program has exactly the raw kernel's operations ({_compared(wrapper["rows"])}),
so the wrapper adds no transpose, cast or copy. `ratio` is median(ours) / median(raw) over alternating rounds of
20 calls.

{report.markdown_table(wrapper["rows"], ["backend", "T", "causal", "pass", "ours_ms", "raw_ms", "ratio", "same_hlo_ops"])}

## End to end: gpt2-small training (`python -m benchmarks.train`)

{img("train_T1024_tokens_per_s.png")} {img("train_T8192_tokens_per_s.png")}

{report.markdown_table(train["rows"], ["backend", "fp8_core", "seq_len", "batch_size", "status", "steps_per_s", "tokens_per_s", "mfu",
                                        "vs_matmul", "time_to_first_step_s", "peak_memory_gib", "final_loss"])}

{oom}

## FP8 (`python -m benchmarks.fp8`; core {fp8["environment"]["core_shape"]}, layer {fp8["environment"]["layer_shape"]}, causal)

{report.markdown_table(fp8["rows"], ["level", "name", "pass", "status", "median_ms", "p10_ms", "p90_ms", "tflops", "vs_matmul", "peak",
                                    "copy_ms", "vs_copy"])}

`copy_ms`: for the two scaling rows, the time a device copy timed in the same process
({fp8["environment"].get("copy_gb_per_s", float("nan")):.0f} GB/s) takes for the bytes that work must move at least;
`vs_copy`: that time over the row's.

| speed-up (same run, ratio of median times) | |
|---|---|
{speedups}

Training loss, te (bf16) vs te-fp8 ([fp8_train.md]({rel}/fp8_train.md)):

{img("fp8_train.png")}
""" + "".join(_included(directory, rel, name, title) for name, title in INCLUDED)


INCLUDED = [  # reports kept as their benchmark wrote them: (path under the results folder, section title)
    ("decode.md", "Decoding with a KV cache (`python -m benchmarks.decode`)"),
    ("decode-batch1/decode.md", "Decoding at batch 1, two rows on a GPU (`benchmarks.decode --batches 1`)"),
    ("packing/layer.md", "Packed documents and sliding windows per call (`benchmarks.layer --sections segments window`)"),
    ("packing/train.md", "Packed vs unpacked training (`benchmarks.train --packing unpacked packed`)"),
    ("gpt-1b/train.md", "Whole-model FP8 at ~1B parameters (`benchmarks.train --preset gpt-1b --seq-len 2048 --batch-size 8`)"),
    ("gpt-1b/fp8_train.md", "gpt-1b, 300 steps: te-fp8 vs cudnn loss (`benchmarks.fp8_train --preset gpt-1b --baseline cudnn`)"),
    ("gpt-1b/fp8_train_cudnn_rerun.md", "gpt-1b, 300 steps: the cudnn run again (`python -m train`)"),
    ("gpt2-small/train.md", "gpt2-small: the bf16 step and whole-model FP8 (`benchmarks.train --backends cudnn te te-fp8`)"),
    ("gpt2-small/steps300/train.md", "gpt2-small over 300 steps (`benchmarks.train --backends cudnn te-fp8 --steps 300`)"),
    ("gpt2-small/bias/train.md", "gpt2-small with and without biases (`benchmarks.train --backends cudnn te te-fp8 --bias with without`)"),
    ("gpt2-small/bias-steps300/train.md", "gpt2-small with and without biases over 300 steps (`benchmarks.train --backends cudnn --bias with without --steps 300`)"),
    ("gpt2-small/bias-alternated/train.md", "gpt2-small, cudnn with and without biases alternated (`benchmarks.train --backends cudnn cudnn --bias with without`)"),
    ("gpt2-small/bias-alternated2/train.md", "gpt2-small, the same alternation again (`--bias without with`)"),
    ("gpt2-small/bias-steps300-b/train.md", "gpt2-small with and without biases over 300 steps, second machine (`--steps 300 --bias without with`)"),
    ("gpt2-small/onepass-ab/train.md", "gpt2-small: the loss reading its logits once, alternated with the step before it (`--bias without`)"),
    ("gpt2-small/96cf60d-bias/train.md", "gpt2-small with and without biases at 96cf60d (`benchmarks.train --backends cudnn te te-fp8 --bias with without`)"),
    ("gpt2-small/d1165d5-bias-alternated/train.md", "gpt2-small at d1165d5, cudnn with and without biases alternated (`benchmarks.train --backends cudnn cudnn --bias with without`)"),
    ("gpt2-small/repeat/train.md", "gpt2-small: four cudnn runs in a row (`benchmarks.train --backends cudnn cudnn cudnn cudnn`)"),
    ("gpt2-medium/train.md", "gpt2-medium (`benchmarks.train --preset gpt2-medium --backends cudnn te te-fp8`)"),
    ("gpt2-medium/bias/train.md", "gpt2-medium with and without biases (`benchmarks.train --preset gpt2-medium --backends cudnn --bias with without`)"),
    ("gpt2-small/step.md", "gpt2-small: one step by parts (`benchmarks.step --attn cudnn`)"),
    ("gpt2-small/trace.md", "gpt2-small: one step's GPU kernels (`train --profile-dir`, `benchmarks.trace`)"),
]


def _compared(rows: list[dict]) -> str:
  """What the wrapper rows' same_hlo_ops compared: their hlo_compared (benchmarks.wrapper.COMPARED), or for rows
  written before it was recorded, what that version compared."""
  said = sorted({r.get("hlo_compared", "opcode counts, fused bodies included; custom calls by count, not by target "
                                        "or settings") for r in rows})
  return "; ".join(said)


def _included(directory: str, rel: str, name: str, title: str) -> str:
  """A report as its benchmark wrote it (its own tables and conventions), under a section of RESULTS.md, its
  images linked from there."""
  path = os.path.join(directory, name)
  if not os.path.exists(path):
    return ""
  body = open(path).read().split("\n", 1)[1].replace("\n## ", "\n### ")  # drop its title; nest its sections
  folder = os.path.dirname(name)
  body = re.sub(r"\]\(([^)/]+\.png)\)", lambda m: f"]({rel}/{folder + '/' if folder else ''}{m.group(1)})", body)
  return f"\n## {title}\n" + body


def main(argv=None) -> None:
  p = flags.Parser(prog="python -m benchmarks.summary", description=flags.description(__doc__))
  p.add_argument("directory", nargs="?", default="benchmarks/results/h200")
  p.add_argument("--out", default="benchmarks/RESULTS.md")
  p.add_argument("--note", help="a line to add under the header, e.g. versions the JSON files do not record")
  a = p.parse_args(argv)
  common.check_out(p, a.out, file=True)  # before any work: a page that cannot be written is refused now
  if os.path.exists(a.directory) and not os.path.isdir(a.directory):
    p.error(f"{a.directory} is a file; give the folder that holds {', '.join(REQUIRED)} (python -m benchmarks.* "
            "--out writes them there)")
  missing = [f"{name} (python -m benchmarks.{by})" for name, by in REQUIRED.items()
             if not os.path.isfile(os.path.join(a.directory, name))]
  if missing:
    p.error(f"{a.directory} lacks {', '.join(missing)}: the page needs all of {', '.join(REQUIRED)} (bash "
            f"benchmarks/h200.sh writes them on a GPU; fp8 and wrapper need one); {a.out} is left as it was")
  rel = os.path.relpath(a.directory, os.path.dirname(os.path.abspath(a.out)))
  page = render(a.directory, rel, a.note)  # the whole page first: a failure leaves the old file whole
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)  # check_out made nothing
  with open(a.out + ".tmp", "w") as f:
    f.write(page)
  os.replace(a.out + ".tmp", a.out)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
