"""`python -m benchmarks.layer --quick`, `benchmarks.train` and `benchmarks.decode --quick` on CPU: every
output kind, rates that are the formula over the measured time, differences to the reference, reasons
on unavailable rows."""

import csv
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import models
from benchmarks import common, decode, fp8, fp8_train, layer, packing, steady, wrapper
from tests import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(module, *args, timeout=900):
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT), timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc


@pytest.mark.slow
def test_layer_quick_writes_json_csv_markdown_and_plots(tmp_path):
  # in-process, every section of --quick at one point of each sweep, each row timed once
  layer.main(["--quick", "--seqs", "64", "--batches", "1", "--calls", "1", "--out", str(tmp_path)])
  result = json.load(open(tmp_path / "layer.json"))
  rows, matmul = result["rows"], result["environment"]["matmul_bf16_tflops"]
  assert len(list(csv.DictReader(open(tmp_path / "layer.csv")))) == len(rows)
  md = (tmp_path / "layer.md").read_text()
  assert "## seq" in md and "lower bound" in md  # the FLOP convention is stated with the table
  assert len(list(tmp_path.glob("*.png"))) >= 5
  sections = {r["section"] for r in rows}
  assert {"default", "seq", "heads", "headdim"} <= sections and any(s.startswith("batch") for s in sections)
  ok = [r for r in rows if r["status"] == "ok"]
  assert {r["backend"] for r in ok} >= {"naive", "xla"}
  for r in ok:  # each rate is the row's FLOP formula over its median time, and its ratio is to this run's matmul
    c = layer.Case(r["section"], r["backend"], r["dtype"], r["B"], r["T"], r["N"], r["K"], r["H"], r["causal"],
                   r["pass"], r["level"])
    assert r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
    assert r["tflops"] == pytest.approx(c.flops() / (r["median_ms"] * 1e-3) / 1e12, rel=1e-9)
    assert r["vs_matmul"] == pytest.approx(r["tflops"] / matmul, rel=1e-9)
  not_ok = [r for r in rows if r["status"] != "ok"]
  assert not_ok and all(r["reason"] for r in not_ok)  # on CPU cudnn/te/te-fp8 rows say why they cannot run
  assert {r["backend"] for r in rows} == {"naive", "xla", "cudnn", "te", "te-fp8", "splash", "cudnn-raw", "te-raw"}
  default = {(r["level"], r["backend"], r["dtype"]): r for r in rows
             if r["section"] == "default" and r["pass"] == "fwd" and r["status"] == "ok"}
  assert "max_abs_diff_vs_naive_f32" not in default[("core", "naive", "float32")]  # the reference is not compared with itself
  for level in ("core", "layer"):
    xla32 = default[(level, "xla", "float32")]["max_abs_diff_vs_naive_f32"]
    xla16 = default[(level, "xla", "bfloat16")]["max_abs_diff_vs_naive_f32"]
    assert xla32 < reference.TOLERANCES[("float32", "out")][0] * 10, xla32
    assert 0 < xla16 < reference.TOLERANCES[("bfloat16", "out")][0] * 10, xla16  # bf16 rounding shows, within bounds


@pytest.mark.slow
def test_layer_quick_segments_and_window_sections(tmp_path, monkeypatch):
  monkeypatch.setattr(layer.common, "matmul_tflops", lambda **_: 1.0)  # its 3 s on a CPU; tested above
  layer.main(["--quick", "--sections", "segments", "window", "--levels", "core", "--out", str(tmp_path)])  # in-process
  result = json.load(open(tmp_path / "layer.json"))
  rows = result["rows"]
  seg = {(r["backend"], r["pass"], r["segments"]): r for r in rows if r["section"] == "segments"}
  win = {(r["backend"], r["pass"], r["T"], r["window"]): r for r in rows if r["section"] == "window"}
  backends, passes = [b for b, _ in layer.BACKEND_DTYPES], ["fwd", "fwd+bwd"]
  assert set(seg) == {(b, p, s["segments"]) for b in backends for p in passes for s in packing.sweep("segments", True)}
  assert set(win) == {(b, p, s["T"], s["window"]) for b in backends for p in passes
                      for s in packing.sweep("window", True)}
  assert all("window" not in r for r in seg.values()) and all("segments" not in r for r in win.values())
  for r in rows:
    if r["backend"] in ("naive", "xla"):
      assert r["status"] == "ok", r
      c = layer.Case(r["section"], r["backend"], r["dtype"], r["B"], r["T"], r["N"], r["K"], r["H"], r["causal"],
                     r["pass"], r["level"], segments=r.get("segments"), window=r.get("window"))
      assert r["tflops"] == pytest.approx(c.flops() / (r["median_ms"] * 1e-3) / 1e12, rel=1e-9)
    else:  # on a CPU: refused, with the reason
      assert r["status"] == "unavailable" and "GPU" in r["reason"], r
  for (b, p, docs), r in seg.items():  # time over the same backend's and pass's unpacked time, this run
    if r["status"] == "ok":
      assert r["time_vs_unpacked"] == pytest.approx(r["median_ms"] / seg[(b, p, None)]["median_ms"], rel=1e-12)
  for (b, p, T, w), r in win.items():  # the full-causal time at the same T over this row's
    if r["status"] == "ok":
      assert r["vs_full"] == pytest.approx(win[(b, p, T, None)]["median_ms"] / r["median_ms"], rel=1e-12)
  assert seg[("xla", "fwd", None)]["time_vs_unpacked"] == 1 and win[("xla", "fwd", 64, None)]["vs_full"] == 1
  md = (tmp_path / "layer.md").read_text()
  for text in ("## segments", "## window", "| time_vs_unpacked |", "| vs_full |", "| none |", "| full |",
               "window=(left, 0) with is_causal=True", "equal-length documents", "Target: 8 documents at T = 4096"):
    assert text in md, text
  names = {p.name for p in tmp_path.glob("*.png")}
  assert {"layer_segments_median_ms.png", "layer_segments_time_vs_unpacked.png", "layer_window_T64_vs_full.png",
          "layer_window_T128_vs_full.png"} == names


def _row(section, backend, level, pass_, T, value, ms, status="ok"):
  return {"section": section, "backend": backend, "dtype": "bfloat16", "level": level, "pass": pass_, "B": 1, "T": T,
          "N": 4, "K": 4, "H": 32, "causal": True, section: value, "status": status, "median_ms": ms}


def test_ratios_use_the_baseline_of_the_same_backend_pass_level_and_T():
  rows = [_row("segments", "te", "core", "fwd", 4096, None, 2.0), _row("segments", "te", "core", "fwd", 4096, 8, 2.1),
          _row("segments", "te", "core", "fwd+bwd", 4096, None, 8.0),
          _row("segments", "te", "layer", "fwd", 4096, 8, 3.0),  # its baseline is missing: no ratio
          _row("segments", "cudnn", "core", "fwd", 4096, None, 1.0, status="error"),
          _row("segments", "cudnn", "core", "fwd", 4096, 8, 1.0),  # its baseline failed: no ratio
          _row("window", "cudnn", "core", "fwd+bwd", 16384, None, 15.0),
          _row("window", "cudnn", "core", "fwd+bwd", 16384, 1024, 3.0),
          _row("window", "cudnn", "core", "fwd+bwd", 8192, None, 4.0),
          _row("window", "cudnn", "core", "fwd+bwd", 8192, 1024, 2.0),
          _row("window", "te", "core", "fwd+bwd", 16384, None, 14.0),
          _row("window", "te", "core", "fwd+bwd", 16384, 1024, 3.5)]
  packing.add_ratios(rows)
  assert [r.get("time_vs_unpacked") for r in rows[:6]] == [1.0, pytest.approx(1.05), 1.0, None, None, None]
  assert [r.get("vs_full") for r in rows[6:]] == [1.0, 5.0, 1.0, 2.0, 1.0, 4.0]
  assert packing.targets("segments", rows[:6]).splitlines()[1:] == [
      "- te core fwd: 1.05 (met)", "- te layer fwd: no ratio (its unpacked row did not run)",
      "- cudnn core fwd: no ratio (its unpacked row did not run)"]
  assert "- core: cudnn (3 ms) 5x (met)" in packing.targets("window", rows[6:])  # the fastest fused backend


def test_vs_xla_is_xlas_time_over_the_rows_for_the_same_case(tmp_path):
  seq = lambda backend, T, ms, status="ok", pass_="fwd+bwd": _row("seq", backend, "core", pass_, T, None, ms, status) | \
      ({} if status == "ok" else {"reason": "RESOURCE_EXHAUSTED"})
  rows = [seq("xla", 1024, 3.0), seq("splash", 1024, 1.5), seq("splash", 1024, 1.0, pass_="fwd"),  # xla: no fwd row
          seq("xla", 8192, None, "error"), seq("splash", 8192, 18.0),  # xla ran out of memory: no ratio
          seq("splash", 2048, 2.0, "error"), seq("xla", 2048, 9.0)]
  layer.add_vs_xla(rows)
  assert [r.get("vs_xla") for r in rows] == [None, 2.0, None, None, None, None, None]
  layer.write(str(tmp_path), {"matmul_bf16_tflops": 1.0}, rows)
  md = (tmp_path / "layer.md").read_text()
  assert layer.VS_XLA_NOTE in md
  assert "| seq | core | splash | bfloat16 | 1 | 1024 | 4 | 4 | 32 | True | fwd+bwd | ok | 1.5 |" in md
  assert md.split("| seq | core | splash | bfloat16 | 1 | 1024 | 4 | 4 | 32 | True | fwd+bwd |")[1].split("\n")[0].rstrip(
      ).endswith("| 2 |"), md  # the last column: vs_xla


@pytest.mark.slow
def test_train_benchmark_writes_rows_for_every_backend(tmp_path):
  run("benchmarks.train", "--preset", "tiny", "--backends", "xla", "cudnn", "--steps", "4", "--batch-size", "4",
      "--seq-len", "32", "--matmul-n", "256", "--out", str(tmp_path))
  result = json.load(open(tmp_path / "train.json"))
  rows, matmul = {r["backend"]: r for r in result["rows"]}, result["environment"]["matmul_bf16_tflops"]
  xla = rows["xla"]
  assert xla["status"] == "ok" and xla["tokens_per_s"] == pytest.approx(xla["steps_per_s"] * 4 * 32)
  assert xla["vs_matmul"] == pytest.approx(xla["model_tflops"] / matmul)
  sustained = result["environment"]["sustained_matmul_bf16_tflops"]
  assert xla["vs_sustained_matmul"] == pytest.approx(xla["model_tflops"] / sustained)
  assert rows["cudnn"]["status"] == "unavailable" and "cuDNN" in rows["cudnn"]["reason"]  # CPU: says why
  assert (tmp_path / "train.csv").exists() and (tmp_path / "train_T32_tokens_per_s.png").exists()
  md = (tmp_path / "train.md").read_text()
  assert "| xla |" in md and "PaLM" in md  # the MFU convention is named beside the table
  assert "sm_mhz" in md and (xla["busy_samples"], xla["sm_mhz"]) == (0, None)  # no nvidia-smi here: no clocks


OPENS_NO_DEVICE = """
import sys
from jax._src import xla_bridge
from benchmarks import train
opened = []
def run_one(backend, preset, seq_len, batch_size, *args, **kwargs):
  opened.append(xla_bridge.backends_are_initialized())
  return {"backend": backend, "preset": preset, "seq_len": seq_len, "batch_size": batch_size, "packing": "unpacked",
          "bias": "with", "status": "ok", "steps_per_s": 1.0, "tokens_per_s": 128.0, "mfu": None,
          "flops_per_token": 1e6, "time_to_first_step_s": 1.0, "peak_memory_gib": None, "final_loss": 5.0,
          "val_loss": None, "attention_notes": None, "sm_mhz": None, "power_w": None, "power_capped_share": None,
          "busy_samples": 0}
train.run_one = run_one
train.main(["--preset", "tiny", "--backends", "xla", "naive", "--seq-len", "32", "--batch-size", "4",
            "--matmul-n", "64", "--out", sys.argv[1]])
print("device opened during the runs:", opened)
"""


def test_the_train_benchmark_opens_no_device_until_its_runs_end(tmp_path):
  """A TPU admits one process at a time: the parent leaves the device to the training runs it starts, and takes it
  (the peak behind model FLOP/s, the yardstick matmul) only after the last."""
  proc = subprocess.run([sys.executable, "-c", OPENS_NO_DEVICE, str(tmp_path)], cwd=ROOT, capture_output=True,
                        text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
  assert "device opened during the runs: [False, False]" in proc.stdout, proc.stdout[-800:] + proc.stderr[-1500:]
  rows = json.load(open(tmp_path / "train.json"))["rows"]
  assert [r["model_tflops"] for r in rows] == [128.0 * 1e6 / 1e12] * 2  # filled in after the runs


def test_a_training_rate_above_the_devices_peak_stops_the_benchmark(monkeypatch):
  """Training rows are checked against the dense peak as per-call rates are: bf16's, FP8's for te-fp8."""
  from benchmarks import flops
  from benchmarks import train as bench_train
  from train import metrics
  monkeypatch.setattr(metrics, "peak_flops", lambda *a: 1e15)  # the device's dense bf16 peak, FLOP/s
  assert bench_train.model_flop_rate("cudnn", 1e6, 9e8) == 9e14
  with pytest.raises(flops.ImpossibleRate, match="cudnn training: 1100.0 TFLOP/s is above the device's bf16 dense"):
    bench_train.model_flop_rate("cudnn", 1e6, 1.1e9)
  assert bench_train.model_flop_rate("te-fp8", 1e6, 1.1e9) == pytest.approx(1.1e15)  # under FP8's 2e15
  with pytest.raises(flops.ImpossibleRate, match="fp8 dense peak"):
    bench_train.model_flop_rate("te-fp8", 1e6, 2.1e9)


@pytest.mark.parametrize("kind, tflops", [
    ("NVIDIA H200", 989), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA GH200 480GB", 989), ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", 835), ("NVIDIA H200 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA L40S", 362),
    ("NVIDIA L40", 181), ("NVIDIA L4", 121), ("NVIDIA A10", 125), ("NVIDIA A10G", None), ("NVIDIA H800", None),
    ("TPU v5 lite", 197), ("TPU v4", None)])
def test_each_device_gets_its_own_boards_dense_peak(kind, tflops):
  """By whole model name: a substring match read an L40 as an L4 (a true rate above 121 TFLOP/s then stopped the
  benchmark as impossible, and MFU was 1.5x too high), an A10G as an A10, an H100 PCIe as the SXM board."""
  from train import metrics
  assert metrics.peak_for(kind) == (tflops and tflops * 1e12)


def test_a_tpu_v5e_gets_its_datasheet_peak_and_the_summary_says_so(monkeypatch):
  """MFU on a TPU v5e divides by its bf16 datasheet peak, 197 TFLOP/s, and the run's summary names it."""
  import types
  from train import metrics
  chip = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
  monkeypatch.setattr(metrics.jax, "local_devices", lambda: [chip])
  assert metrics.peak_flops() == 197e12
  assert metrics.peak_fields(197e12, None) == {"mfu_peak_tflops": 197.0,
                                               "mfu_peak": "the bf16 datasheet peak of TPU v5 lite"}
  assert metrics.peak_fields(5e14, 500.0)["mfu_peak"] == "--peak-tflops"
  assert metrics.peak_fields(None, None) == {"mfu_peak_tflops": None, "mfu_peak": None}


def test_a_training_row_says_how_its_attention_ran(monkeypatch):
  """te-fp8 with --fp8-core fp8-or-bf16 may run TE's bf16 core (gpt2-small's head dim 64): the trainer's summary
  carries the plans' notes and the benchmark's row and table show them."""
  import attnlayers
  from benchmarks import train as bench_train
  from train import report as train_report
  cfg = models.preset("tiny", backend="xla")
  bf16_core = "core: TransformerEngine bf16 fused attention (fp8_core='fp8-or-bf16'), because ..."
  plan = attnlayers.explain("xla", *[jax.ShapeDtypeStruct((2, 8, cfg.n_head, cfg.head_dim), jnp.float32)] * 3)
  monkeypatch.setattr(train_report, "attention_plans", lambda *a: [dataclasses.replace(plan, notes=(bf16_core,))] * 2)
  assert train_report.attention_notes(cfg, 2) == [bf16_core]  # once, whatever the number of layer kinds
  row = {"backend": "te-fp8", "preset": "tiny", "seq_len": 64, "batch_size": 2, "status": "ok",
         "attention_notes": bf16_core}
  assert f"te-fp8 T=64: {bf16_core}" in bench_train.table([row])


def test_steady_times_traces_and_rates_the_trainer_step_against_both_matmuls(tmp_path, capsys):
  rows = steady.main(["--attn", "xla", "--preset", "tiny", "--seq-len", "32", "--batch-size", "2", "--warmup", "1",
                      "--steps", "2", "--trace-steps", "1", "--matmul-n", "64", "--sustain-calls", "2",
                      "--out", str(tmp_path)])  # in-process
  assert json.load(open(tmp_path / "steady.json"))["rows"] == json.loads(json.dumps(rows))
  assert "| timed again |" in (tmp_path / "steady.md").read_text()
  by = {r["phase"]: r for r in rows}
  assert list(by) == ["warmup", "timed", "traced", "timed again", "matmul", "matmul, sustained"]
  assert (by["timed"]["steps"], by["traced"]["steps"], by["matmul, sustained"]["calls"]) == (2, 1, 2)
  cfg = models.preset("tiny", seq_len=32)
  flops = models.flops_per_token(cfg, models.count_params(models.GPT(cfg, rngs=nnx.Rngs(0))), 32) * 2 * 32
  for phase in ("timed", "traced", "timed again"):
    r = by[phase]
    assert r["model_tflops"] == pytest.approx(flops / (r["ms_per_step"] * 1e-3) / 1e12)
    assert r["vs matmul"] == pytest.approx(r["model_tflops"] / by["matmul"]["tflops"])
    assert r["vs matmul, sustained"] == pytest.approx(r["model_tflops"] / by["matmul, sustained"]["tflops"])
  assert "model_tflops" not in by["warmup"]  # its first step compiles
  traced = by["traced"]
  if jax.devices()[0].platform == "gpu":  # the trace's kernels, per step
    assert 0 < traced["gpu_busy_ms"] <= traced["gpu_span_ms"]
  else:  # a CPU: no GPU kernels, no clocks
    assert traced["gpu_span_ms"] is None and by["timed"]["busy_samples"] == 0
  assert "| traced |" in capsys.readouterr().out


def test_steady_refuses_a_phase_of_no_steps(capsys):
  with pytest.raises(SystemExit):
    steady.main(["--steps", "0"])
  assert "--steps must be at least 1; got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_train_benchmark_runs_packed_beside_unpacked_with_the_same_validation(tmp_path):
  run("benchmarks.train", "--preset", "tiny", "--backends", "xla", "--packing", "unpacked", "packed", "--steps", "4",
      "--batch-size", "4", "--seq-len", "32", "--matmul-n", "256", "--out", str(tmp_path))
  rows = {r["packing"]: r for r in json.load(open(tmp_path / "train.json"))["rows"]}
  assert rows["unpacked"]["status"] == rows["packed"]["status"] == "ok", rows
  assert rows["packed"]["vs_unpacked"] == pytest.approx(rows["packed"]["tokens_per_s"] / rows["unpacked"]["tokens_per_s"])
  assert all(math.isfinite(r["val_loss"]) and r["val_loss"] != r["final_loss"] for r in rows.values())
  assert "vs_unpacked" in (tmp_path / "train.md").read_text()


@pytest.mark.slow
def test_train_benchmark_runs_the_model_without_biases_beside_it(tmp_path):
  run("benchmarks.train", "--preset", "tiny", "--backends", "xla", "--bias", "with", "without", "--steps", "4",
      "--batch-size", "4", "--seq-len", "32", "--matmul-n", "256", "--out", str(tmp_path))
  rows = {r["bias"]: r for r in json.load(open(tmp_path / "train.json"))["rows"]}
  assert rows["with"]["status"] == rows["without"]["status"] == "ok", rows
  assert rows["with"]["final_loss"] != rows["without"]["final_loss"]  # two models, not one run twice
  assert "| xla | tiny | unpacked | without |" in (tmp_path / "train.md").read_text()  # no fp8_core column: no te-fp8 row



def _decode_params_bytes(cfg) -> int:
  """Bytes of the parameters a decode step reads, counted from the model's structure: all but the position table."""
  params = nnx.state(nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  return sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
             if "wpe" not in jax.tree_util.keystr(path)) * jnp.dtype(cfg.dtype).itemsize


@pytest.mark.slow
def test_decode_quick_rows_are_their_formulas_over_the_measured_time(tmp_path):
  decode.main(["--quick", "--out", str(tmp_path)])  # in-process: tiny models, naive/xla measured, cudnn refused
  result = json.load(open(tmp_path / "decode.json"))
  rows, copy = result["rows"], result["environment"]["copy_gb_per_s"]
  assert copy > 0 and len(list(csv.DictReader(open(tmp_path / "decode.csv")))) == len(rows)
  assert len(list(tmp_path.glob("decode_tokens_per_s_*.png"))) == 2  # tokens/s vs batch, per context
  fractions = {r["batch"]: set() for r in rows}  # copy fraction vs context, per batch where two contexts have one
  for r in rows:
    if r["section"] == "sweep" and r.get("frac_copy_bw") is not None:
      fractions[r["batch"]].add(r["context"])
  assert len(list(tmp_path.glob("decode_frac_copy_bw_*.png"))) == sum(len(c) > 1 for c in fractions.values())
  md = (tmp_path / "decode.md").read_text()
  assert "lower bound" in md and "Time to first token" in md and "MQA (K=1) / MHA (K=4) tokens/s at batch 4" in md
  sweep = [r for r in rows if r["section"] == "sweep"]
  assert {(r["backend"], r["K"], r["batch"], r["context"]) for r in sweep} == \
      set(itertools.product(["naive", "xla", "cudnn"], [4, 1], [1, 4], [32, 128])) | \
      set(itertools.product(["naive", "xla", "cudnn"], [4, 1], [1], [64]))  # batch 1 at --batch1-context
  assert {r["xla_options"] for r in sweep} == {"decode"} and all(r.get("kernels_per_step") is None for r in sweep)
  ok = [r for r in rows if r["status"] == "ok"]
  assert {r["backend"] for r in ok} == {"naive", "xla"} and {r["model"] for r in ok} == {"tiny", "tiny@256"}
  ttft = {r["backend"]: r for r in rows if r["section"] == "ttft"}
  assert ttft["xla"]["status"] == "ok" and ttft["xla"]["context"] == 128 and ttft["xla"]["batch"] == 1
  for r in rows:
    if r["status"] != "ok":  # cudnn on a CPU: every point says why
      assert r["backend"] == "cudnn" and r["status"] == "unavailable" and "cuDNN" in r["reason"]
  for r in ok:
    for key, value in r.items():
      if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert math.isfinite(value) and (value > 0 or key == "compile_s" and value == 0), (key, value)
    cfg = models.preset("tiny", n_kv_head=r["K"], seq_len=256 if r["model"] == "tiny@256" else None)
    B, L, K, H, size = r["batch"], cfg.n_layer, r["K"], cfg.head_dim, jnp.dtype(cfg.dtype).itemsize
    assert r["cache_len"] == r["context"] + r["steps"]
    assert r["kv_cache_bytes"] == 2 * L * B * r["cache_len"] * K * H * size == r["kv_cache_mib"] * 2**20
    assert r["param_bytes"] == _decode_params_bytes(cfg)
    assert r["bytes_per_step"] == r["param_bytes"] + 2 * L * B * r["context"] * K * H * size
    step_s = r["decode_ms_per_step"] * 1e-3
    assert r["tokens_per_s"] == pytest.approx(B / step_s, rel=1e-9)
    assert r["gb_per_s"] == pytest.approx(r["bytes_per_step"] / step_s / 1e9, rel=1e-9)
    if r["gb_per_s"] <= copy:  # a fraction of the copy's rate, never above it
      assert r["frac_copy_bw"] == pytest.approx(r["gb_per_s"] / copy, rel=1e-9) and "frac_copy_bw_omitted" not in r
    else:  # bytes a CPU serves from its caches: the copy bounds nothing there, and no fraction is given
      assert r["frac_copy_bw"] is None and "cache" in r["frac_copy_bw_omitted"], r
    assert r["prefill_tokens_per_s"] == pytest.approx(B * r["context"] / (r["prefill_ms"] * 1e-3), rel=1e-9)
    assert r["prefill_p10_ms"] <= r["prefill_ms"] <= r["prefill_p90_ms"]
    assert r["decode_p10_ms_per_step"] <= r["decode_ms_per_step"] <= r["decode_p90_ms_per_step"]


def test_decode_gives_no_copy_fraction_above_1_and_says_why():
  """A step whose bytes/s pass the same-run copy's moved them from a nearer cache (a tiny model on a CPU): its
  frac_copy_bw is left out, the row says why, and the report says how many rows and against what."""
  from benchmarks import decode_report
  rows = [{"status": "ok", "gb_per_s": 2.0, "bytes_per_step": 2**20},
          {"status": "ok", "gb_per_s": 20.0, "bytes_per_step": 3 * 2**20, "frac_copy_bw": 4.0},
          {"status": "unavailable"}]
  decode_report.add_fractions(rows, 5.0)
  assert rows[0]["frac_copy_bw"] == 0.4 and "frac_copy_bw_omitted" not in rows[0]
  assert rows[1]["frac_copy_bw"] is None
  assert rows[1]["frac_copy_bw_omitted"] == ("gb_per_s 20 passes the same-run copy's 5 GB/s: the step's 3 MiB came "
                                             "from a cache nearer than the memory the copy measures")
  assert "frac_copy_bw" not in rows[2]
  line = decode_report.omitted_line(rows, {"copy_gb_per_s": 5.0, "copy_bytes": 2**26})
  assert line.startswith("`frac_copy_bw` is left out of 1 of 2 measured rows: their gb_per_s (up to 20) passes the "
                         "copy's 5 GB/s (x + 1 in place over 64 MiB)"), line
  assert decode_report.omitted_line(rows[:1], {"copy_gb_per_s": 5.0, "copy_bytes": 2**26}) == ""


def test_decode_targets_read_the_rows_they_name_and_say_met_or_not():
  from benchmarks import decode, decode_report
  row = lambda K, B, c, ms, **kw: {"status": "ok", "section": "sweep", "backend": "cudnn", "xla_options": "decode",
                                   "N": 12, "K": K, "batch": B, "context": c, "decode_ms_per_step": ms,
                                   "tokens_per_s": B / (ms * 1e-3), **kw}
  rows = [row(12, 1, 1536, 0.29, kernels_per_step=90.0), row(4, 1, 1536, 0.31), row(12, 64, 2048, 1.0, frac_copy_bw=0.9),
          row(4, 64, 2048, 0.5, frac_copy_bw=0.6, kernels_per_step=120.0)]
  lines = decode_report.target_lines(rows, decode.TARGETS)
  assert "- cudnn (decode) K=12, batch 1, context 1536: ms per token: 0.29 (target <= 0.3: met)" in lines
  assert "- cudnn (decode) K=4, batch 1, context 1536: ms per token: 0.31 (target <= 0.3: not met)" in lines
  assert "- cudnn (decode) K=1, batch 1, context 1536: ms per token: not measured in this run (target <= 0.3)" in lines
  assert "- cudnn (decode) K=12, batch 64, context 2048: fraction of the copy bandwidth: 0.9 (target >= 0.85: met)" in lines
  assert "- cudnn (decode) K=4, batch 64, context 2048: fraction of the copy bandwidth: 0.6 (target >= 0.7: not met)" in lines
  assert "- cudnn (decode) K=4 / MHA tokens/s, batch 64, context 2048: 2 (target >= 2.2: not met)" in lines
  assert "- cudnn (decode) kernels per decode step (the most of any point): 120 (target <= 100: not met)" in lines
  graphs = decode_report.target_lines([r | {"kernels_per_step": None, "command_buffers": True} for r in rows],
                                      decode.TARGETS)
  assert graphs[-1].startswith("- cudnn (decode) kernels per decode step: not counted (command buffers"), graphs


def test_decode_kernel_count_is_the_decode_programs_gpu_events_over_its_steps():
  from benchmarks import decode
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  kernel = lambda pid, module: {"ph": "X", "pid": pid, "ts": 0, "dur": 2, "name": "k",
                                "args": {"hlo_module": module, "hlo_op": "fusion.1"}}
  events = meta + [kernel(1, "jit__decode")] * 12 + [kernel(1, "jit__fill")] * 5 + [kernel(2, "jit__decode")] * 7
  assert decode.count_kernels(events, 4) == 3.0  # the GPU's, of jit__decode: not the cache-index fill, not host events
  assert decode.count_kernels(meta, 4) is None


def test_the_copy_yardstick_updates_one_buffer_in_place(monkeypatch):
  """Each timed call donates the previous call's output, so no call allocates one: on a CPU a fresh 64 MiB output
  per call is memory the OS maps and zeroes, and the copy measured that (about 3 GB/s, where in place reads ~40)."""
  from benchmarks import decode_report
  outputs = []

  def two_calls(fn, *args, **kwargs):
    outputs.extend([fn(*args), fn(*args)])
    return common.Timing(median_ms=1.0, p10_ms=1.0, p90_ms=1.0, calls=2)
  monkeypatch.setattr(common, "time_fn", two_calls)
  assert decode_report.copy_gb_per_s(2**20) == pytest.approx(2 * 2**20 / 1e-3 / 1e9)  # read + write, 1 ms
  first, second = outputs
  assert first.is_deleted() and not second.is_deleted()  # the second call took the first's buffer


def test_decode_budget_stops_cleanly_and_still_writes_every_file(tmp_path):
  decode.main(["--quick", "--budget-s", "1e-9", "--out", str(tmp_path)])
  rows = json.load(open(tmp_path / "decode.json"))["rows"]
  assert rows and all(r["status"] == "skipped" and "--budget-s" in r["reason"] for r in rows)
  assert (tmp_path / "decode.csv").exists() and "not run" in (tmp_path / "decode.md").read_text()



def test_a_point_failing_without_a_message_is_an_error_row_and_every_file_is_written(tmp_path, monkeypatch):
  def fail(*_):
    raise AssertionError  # no message: the row's reason is the error's type
  monkeypatch.setattr(decode, "_measure", fail)
  decode.main(["--quick", "--backends", "xla", "--batches", "1", "--contexts", "32", "--out", str(tmp_path)])
  rows = json.load(open(tmp_path / "decode.json"))["rows"]
  assert rows and all(r["status"] == "error" and r["reason"] == "AssertionError" for r in rows)
  assert (tmp_path / "decode.csv").exists() and (tmp_path / "decode.md").exists()
  assert common.reason(ValueError("first line\nsecond"), 5) == "ValueError: first"


def test_clock_samples_parse_and_only_busy_ones_are_summarised():
  from benchmarks import clocks
  lines = ["1590, 1980, 690.5, 700.00, 100, 0x0000000000000004",  # busy, power-capped
           "1980, 1980, 600.0, 700.00, 95, 0x0000000000000000",  # busy
           "1620, 1980, 694.0, 700.00, 99, 0x0000000000000004",  # busy, power-capped
           "345, 1980, 120.0, 700.00, 0, 0x0000000000000001",  # idle (compiling): not the work's
           "[N/A], 1980, 120.0, 700.00, 0, 0x0"]  # unreadable
  samples = [clocks.parse(line) for line in lines]
  assert samples[-1] is None
  got = clocks.summarize([s for s in samples if s])
  assert got == {"sm_mhz": 1620.0, "sm_max_mhz": 1980.0, "power_w": 690.5, "power_limit_w": 700.0,
                 "power_capped_share": 2 / 3, "busy_samples": 3}
  idle = clocks.summarize(samples[3:4])  # the board's figures, but nothing about the work
  assert idle["sm_mhz"] is None and idle["busy_samples"] == 0 and idle["sm_max_mhz"] == 1980.0


def _fake_nvidia_smi(tmp_path, monkeypatch, body: str):
  """An executable `nvidia-smi` first on PATH that runs `body` (sh)."""
  (tmp_path / "nvidia-smi").write_text("#!/bin/sh\n" + body + "\n")
  (tmp_path / "nvidia-smi").chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("body, busy, error", [
    ('while true; do echo "1600, 1980, 690.0, 700.00, 100, 0x4"; sleep 0.05; done', True, None),
    ("sleep 1000", False, None),  # hangs: the block still ends
    ('echo \'Field "clocks.max.sm" is not a valid field to query.\'; exit 2', False, "not a valid field"),
    ("exit 3", False, "exited with code 3"),
], ids=["samples", "hangs", "fails", "fails silently"])
def test_clock_sampler_reads_nvidia_smi_and_ends_whatever_it_does(tmp_path, monkeypatch, body, busy, error):
  import time
  from benchmarks import clocks
  _fake_nvidia_smi(tmp_path, monkeypatch, body)
  t = time.perf_counter()
  with clocks.Sampler() as gpu:
    time.sleep(0.5)
  assert time.perf_counter() - t < 8
  got = gpu.summary()
  assert (got["busy_samples"] > 0) == busy and (got["sm_mhz"] == 1600.0) == busy
  assert (error is None and got["error"] is None) or error in got["error"]


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="on a GPU the kernels run: nothing to refuse")
def test_wrapper_refuses_in_one_line_where_its_kernel_cannot_run(capsys):
  with pytest.raises(SystemExit) as e:
    wrapper.main(["--backends", "cudnn"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --backends cudnn: cuDNN fused attention needs an NVIDIA GPU") and "backend=" not in err
  assert len(err.strip().splitlines()) == 1, err


def _no_timing(*args, **kwargs):
  raise AssertionError("timed something before refusing")


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="on a GPU the kernels run: nothing to refuse")
@pytest.mark.parametrize("main, args, named", [
    (fp8.main, [], ["cudnn at --core 2 8192 32 128", "te at --core", "te-fp8 at --layer 4 4096 4096 32"]),
    (fp8_train.main, ["--steps", "2"], ["--baseline te", "te-fp8"]),
], ids=["fp8", "fp8_train"])
def test_fp8_benchmarks_refuse_in_one_line_before_any_timing_or_folder(main, args, named, tmp_path, capsys,
                                                                       monkeypatch):
  """Each names every kernel it would time that cannot run here, and why, as benchmarks.wrapper does; nothing is
  timed (the matmul yardstick came first) and --out is not made."""
  monkeypatch.setattr(common, "time_fn", _no_timing)
  out = tmp_path / "out"
  with pytest.raises(SystemExit) as e:
    main([*args, "--out", str(out)])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
  assert "needs an NVIDIA GPU" in err and "backend=" not in err and all(n in err for n in named), err
  assert not out.exists()


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="the GPU yardstick is 8192^3")
def test_the_matmul_yardstick_is_small_off_a_gpu():
  assert common.yardstick_n() == 512  # an 8192^3 bf16 matmul chain takes minutes a call on a CPU


def test_summary_refuses_a_file_for_its_folder_and_makes_the_folder_of_its_page(tmp_path, capsys, monkeypatch):
  """A file given as the folder said it 'lacks layer.json, ...'; --out in a folder not there yet ended in a
  FileNotFoundError traceback after the page was rendered."""
  from benchmarks import summary
  (tmp_path / "notes.txt").write_text("x")
  with pytest.raises(SystemExit) as e:
    summary.main([str(tmp_path / "notes.txt"), "--out", str(tmp_path / "R.md")])
  assert e.value.code == 2 and f"{tmp_path / 'notes.txt'} is a file; give the folder that holds layer.json" in \
      capsys.readouterr().err
  monkeypatch.chdir(ROOT)
  summary.main(["benchmarks/results/h200", "--out", str(tmp_path / "new" / "R.md")])
  assert (tmp_path / "new" / "R.md").read_text().startswith("#")


def test_summary_writes_the_published_page_again_and_refuses_a_folder_without_its_inputs(tmp_path, capsys,
                                                                                        monkeypatch):
  """benchmarks.summary on the published results reproduces RESULTS.md; on a folder without the JSON files it
  exits 2 naming them, and the page it would have written is left as it was (it was emptied first)."""
  from benchmarks import summary
  page = os.path.join(ROOT, "benchmarks", "RESULTS.md")
  out = tmp_path / "RESULTS.md"
  out.write_text("the page before")
  with pytest.raises(SystemExit) as e:
    summary.main([str(tmp_path / "nowhere"), "--out", str(out)])
  assert e.value.code == 2 and "lacks layer.json (python -m benchmarks.layer), fp8.json" in capsys.readouterr().err
  assert out.read_text() == "the page before"
  monkeypatch.chdir(ROOT)  # the page names the folder as given, and links it from the page's own folder
  assert summary.render("benchmarks/results/h200", "results/h200") == open(page).read()


@pytest.mark.parametrize("module, args, message", [
    ("benchmarks.layer", ["--quick", "--seqs", "0"], "--seqs: must be >= 1, got 0"),
    ("benchmarks.layer", ["--quick", "--calls", "0"], "--calls: must be >= 1, got 0"),
    ("benchmarks.layer", ["--merge", "/nonexistent/layer.json"], "--merge: no such file: /nonexistent/layer.json"),
    ("benchmarks.layer", ["--quick", "--sections", "window", "--backends", "cudnn-raw"],
     "no rows: --sections window has no row of --backends cudnn-raw"),
    ("benchmarks.layer", ["--merge", "runs/x.json", "--backends", "naive", "--calls", "5"],
     "--merge times nothing and writes every row of its files: --calls, --backends would be ignored"),
    ("benchmarks.layer", ["--quick", "--sections", "default", "--seqs", "64"],
     "--seqs sets the seq section's points; --sections default has no seq"),
    ("benchmarks.train", ["--steps", "1"], "--steps: must be >= 2, got 1"),
    ("benchmarks.train", ["--matmul-n", "0"], "--matmul-n: must be >= 1, got 0"),
    ("benchmarks.train", ["--seq-len", "-8"], "--seq-len: must be >= 1, got -8"),
    ("benchmarks.train", ["--run-timeout", "0"], "--run-timeout: must be a finite number > 0, got 0"),
    ("benchmarks.fp8", ["--calls", "0"], "--calls: must be >= 1, got 0"),
    ("benchmarks.fp8", ["--core", "2", "0", "32", "128"], "--core: must be >= 1, got 0"),
    ("benchmarks.fp8", ["--layer", "4", "4096", "4000", "30"], "D (4000) must be a multiple of N (30)"),
    ("benchmarks.fp8_train", ["--lr", "0"], "--lr: must be a finite number > 0, got 0"),
    ("benchmarks.fp8_train", ["--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    ("benchmarks.fp8_train", ["--n-head", "3"], "d_model (512) must be divisible by n_head (3)"),
    ("benchmarks.wrapper", ["--seqs", "0"], "--seqs: must be >= 1, got 0"),
    ("benchmarks.wrapper", ["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    ("benchmarks.decode", ["--quick", "--calls", "0"], "--calls: must be >= 1, got 0"),
    ("benchmarks.decode", ["--quick", "--contexts", "100000"], "--contexts / --ttft-context 100000: the longest "
     "context this benchmark's tiny variants hold is 256"),
    ("benchmarks.step", ["--preset", "tiny", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    ("benchmarks.steady", ["--preset", "tiny", "--seq-len", "0"], "--seq-len: must be >= 1, got 0"),
    # an empty --data trained on the default text
    ("benchmarks.train", ["--preset", "tiny", "--data", ""], "argument --data: an empty path"),
    # every run failed on it, after the matmul yardstick, and the benchmark exited 1
    ("benchmarks.train", ["--preset", "tiny", "--data", "/nonexistent/d.txt"],
     "--data '/nonexistent/d.txt': no such file or folder"),
    # "no such file" of a folder; the same file twice merged its rows twice
    ("benchmarks.layer", ["--merge", "benchmarks"], "--merge: benchmarks: a folder; give the layer.json files in it"),
    ("benchmarks.layer", ["--merge", "benchmarks/results/h200/layer.json", "benchmarks/../benchmarks/results/h200/"
                          "layer.json"], "are one file: its rows would be merged twice"),
], ids=["layer-seqs-0", "layer-calls-0", "layer-merge-missing", "layer-no-rows", "layer-merge-ignores",
        "layer-seqs-without-seq", "train-steps-1", "train-matmul-0",
        "train-seq-len-negative", "train-run-timeout-0", "fp8-calls-0", "fp8-core-T-0", "fp8-layer-D-N",
        "fp8_train-lr-0", "fp8_train-batch-0", "fp8_train-heads", "wrapper-seqs-0", "wrapper-rounds-0",
        "decode-calls-0", "decode-context-too-long", "step-batch-0", "steady-seq-len-0", "train-data-empty", "train-data-missing", "layer-merge-folder", "layer-merge-twice"])
@pytest.mark.filterwarnings("ignore:'benchmarks\\..*' found in sys.modules:RuntimeWarning")
def test_bad_benchmark_flags_exit_2_before_any_timing(module, args, message, capsys, monkeypatch, tmp_path):
  """`python -m MODULE ARGS` in this process: runpy runs the module as __main__, as python -m does."""
  import runpy
  monkeypatch.setattr(sys, "argv", [module, *args, "--out", str(tmp_path / "out")])  # writable: the flag fails
  with pytest.raises(SystemExit) as e:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  err = capsys.readouterr().err
  assert e.value.code == 2 and message in err, err[-1500:]
  assert len(err.strip().splitlines()) == 1, err[-1500:]


@pytest.mark.parametrize("module, out", [("benchmarks.layer", ""), ("benchmarks.decode", " ")])
@pytest.mark.filterwarnings("ignore:'benchmarks\\..*' found in sys.modules:RuntimeWarning")
def test_an_empty_out_is_refused_before_any_timing(module, out, capsys, monkeypatch, tmp_path):
  """--out "$OUT" with OUT unset timed every row and wrote them into the working folder."""
  import runpy
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(common, "time_fn", _no_timing)
  monkeypatch.setattr(sys, "argv", [module, "--quick", "--out", out])
  with pytest.raises(SystemExit) as e:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  err = capsys.readouterr().err
  assert e.value.code == 2 and f"--out {out!r} is an empty path (an unset variable?): leave out --out for its " \
                               "default" in err, err
  assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_python_m_a_benchmark_exits_2_on_a_bad_flag():
  """The process boundary itself: a new python, its exit status and stderr."""
  proc = subprocess.run([sys.executable, "-m", "benchmarks.layer", "--quick", "--seqs", "0", "--out",
                         "/nonexistent-out"], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
  assert proc.returncode == 2 and "--seqs: must be >= 1, got 0" in proc.stderr, proc.stderr[-1500:]
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-1500:]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN runs here: nothing to refuse")
@pytest.mark.parametrize("name", ["step", "steady"])
def test_step_benchmarks_refuse_an_attention_kernel_that_cannot_run_in_one_line(name, capsys, monkeypatch):
  """benchmarks.step and benchmarks.steady say why --attn cudnn cannot run here, before building anything (they
  ended in a traceback from inside the first timed call)."""
  from benchmarks import step
  main = {"step": step.main, "steady": steady.main}[name]
  monkeypatch.setattr(models, "GPT", lambda *a, **k: pytest.fail("built the model"))
  with pytest.raises(SystemExit) as e:
    main(["--preset", "tiny", "--attn", "cudnn", "--batch-size", "2", "--seq-len", "32"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith("error: --attn cudnn: cuDNN fused attention needs an NVIDIA GPU"), err
  assert "give another --attn" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_train_benchmark_exits_non_zero_when_every_run_failed(tmp_path):
  """Each run's reason is printed, no report replaces one already in --out, and the exit status says so (a --data
  too short for --seq-len: it exists, so the benchmark's own check passes it, and each run refuses it)."""
  (tmp_path / "short.txt").write_text("forty bytes of text, too few for T = 32.")
  proc = subprocess.run([sys.executable, "-m", "benchmarks.train", "--preset", "tiny", "--backends", "xla",
                         "--steps", "2", "--seq-len", "32", "--batch-size", "4", "--matmul-n", "64",
                         "--data", str(tmp_path / "short.txt"), "--out", str(tmp_path)], cwd=ROOT,
                        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
  assert proc.returncode == 1 and "every run failed (1)" in proc.stderr, proc.stderr[-1500:]
  assert "too little for --seq-len 32" in proc.stdout and not (tmp_path / "train.json").exists()  # reason, no report


def test_same_run_ratios_are_set_before_the_table_is_printed(capsys):
  """The printed table and the written report carry the same vs_cudnn and vs_xla (vs_cudnn was once filled in only
  when writing); a column no row fills is left out."""
  from benchmarks import train as bench_train
  row = {"preset": "p", "seq_len": 8, "batch_size": 2, "packing": "unpacked", "bias": "with", "status": "ok"}
  rows = [row | {"backend": "cudnn", "tokens_per_s": 100.0}, row | {"backend": "te-fp8", "tokens_per_s": 105.0},
          row | {"backend": "xla", "tokens_per_s": 50.0}, row | {"backend": "splash", "seq_len": 16, "tokens_per_s": 9.0}]
  for base in ("cudnn", "xla"):
    bench_train.add_vs(rows, base)
  assert [r.get("vs_cudnn") for r in rows] == [1.0, 1.05, 0.5, None]  # no cudnn row at T=16
  assert [r.get("vs_xla") for r in rows] == [2.0, 2.1, 1.0, None]
  text = bench_train.table(rows)
  assert "| 1.05 |" in text and "| 2.1 |" in text and "vs_unpacked" not in text and "fp8_core" not in text


@pytest.mark.parametrize("make", [
    lambda tmp: tmp / "nonexistent",
    lambda tmp: tmp,  # a folder holding no perfetto_trace.json.gz
    lambda tmp: (tmp / "perfetto_trace.json.gz").write_text("not gzip") and tmp / "perfetto_trace.json.gz",
], ids=["missing", "folder-without-one", "not-a-trace"])
def test_trace_refuses_a_path_without_a_trace_in_one_line(make, tmp_path, capsys):
  from benchmarks import trace
  path = make(tmp_path)
  with pytest.raises(SystemExit) as e:
    trace.main([str(path)])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith(f"error: {path}") and len(err.strip().splitlines()) == 1, err
  assert "python -m train --profile-dir" in err, err  # what writes one


@pytest.mark.parametrize("name", ["decode", "fp8", "fp8_train", "layer", "steady", "step", "summary", "trace", "train",
                                  "wrapper"])
def test_help_describes_each_benchmark_with_its_docstrings_whole_first_paragraph(name, capsys, monkeypatch):
  import importlib
  module = importlib.import_module(f"benchmarks.{name}")
  monkeypatch.setenv("COLUMNS", "1000")
  with pytest.raises(SystemExit) as e:
    module.main(["--help"])
  assert e.value.code == 0
  first = " ".join(module.__doc__.split("\n\n")[0].split())
  assert first in " ".join(capsys.readouterr().out.split())


def test_the_wrapper_comparison_tells_custom_calls_apart_by_target_and_settings():
  """benchmarks.wrapper's op counts key a custom call by its target and backend_config, less where and with which
  engine it runs: the same cuDNN call on another stream or algorithm is the same op; with another mask type, or
  the backward kernel, it is not. A config that is not JSON (an FFI call's attributes) is compared as written."""
  from benchmarks import wrapper
  def call(target="__cudnn$fmhaSoftmax", mask="CAUSAL", queue="0", algo="0"):
    return (f'  fmha = (bf16[2,16,1024,128]{{3,2,1,0}}, u8[0]{{0}}) custom-call(p0, p1, p2), custom_call_target="'
            f'{target}", api_version=API_VERSION_STATUS_RETURNING, backend_config={{"operation_queue_id": "{queue}", '
            f'"wait_on_operation_queues": [], "cudnn_fmha_backend_config": {{"algorithm": {{"algo_id": "{algo}"}}, '
            f'"fmha_scale": 0.088, "mask_type": "{mask}"}}}}, metadata={{op_name="x"}}')
  base = wrapper.count_ops("\n".join([call(), "  t = bf16[2]{0} transpose(p0), dimensions={0}"]))
  assert base["transpose"] == 1 and sum(base.values()) == 2
  assert wrapper.count_ops(call(queue="3", algo="7")) == wrapper.count_ops(call())
  assert wrapper.count_ops(call(mask="NO_MASK")) != wrapper.count_ops(call())
  assert wrapper.count_ops(call(target="__cudnn$fmhaSoftmaxBackward")) != wrapper.count_ops(call())
  ffi = ('  c = f32[4]{0} custom-call(p0), custom_call_target="te_fused_attn_forward_ffi", '
         'api_version=API_VERSION_TYPED_FFI, backend_config={attn_mask_type = %d : i64, scale = 1.0 : f32}, x={y}')
  assert list(wrapper.count_ops(ffi % 2)) == [
      "custom-call te_fused_attn_forward_ffi {attn_mask_type = 2 : i64, scale = 1.0 : f32}"]
  assert wrapper.count_ops(ffi % 2) != wrapper.count_ops(ffi % 0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_raw_te_call_takes_the_settings_attnlayers_hands_te(monkeypatch, causal):
  """benchmarks.wrapper's raw TE call and attnlayers' te backend hand fused_attn the same settings (read from a
  stand-in TE), the scale included to the last bit: hlo_ops compares the custom calls' settings (an FFI call's
  scaling_factor is an f64 attribute), and the raw call's H ** -0.5 was an ulp above attnlayers' 1 / sqrt(H) at
  H = 128, so tests/test_gpu_te.py's test_te_core_compiles_to_the_raw_kernels_program saw two custom calls where
  the op counts agree. cudnn's raw call takes jax's default scale, 1 / np.sqrt(H), which is attnlayers' too."""
  import types

  from attnlayers import spec
  from attnlayers.backends import te as te_backend
  seen = []

  def fused_attn(qkv, bias, lengths, seed, window_size=None, **kwargs):  # TE's default window_size: None
    seen.append(kwargs | {"bias": bias, "window_size": window_size})
    return qkv[0]
  names = lambda *xs: types.SimpleNamespace(**{x: x for x in xs})
  fake = types.ModuleType("transformer_engine.jax.attention")
  fake.fused_attn = fused_attn
  fake.SequenceDescriptor = types.SimpleNamespace(from_seqlens=lambda lengths: lengths)
  fake.AttnMaskType = names("NO_MASK", "CAUSAL_MASK", "PADDING_MASK", "PADDING_CAUSAL_MASK")
  fake.AttnBiasType = names("NO_BIAS", "POST_SCALE_BIAS")
  fake.QKVLayout = names("BSHD_BSHD_BSHD", "THD_THD_THD")
  fake.AttnSoftmaxType = names("VANILLA_SOFTMAX")
  parent = types.ModuleType("transformer_engine.jax")
  parent.attention = fake
  monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
  monkeypatch.setitem(sys.modules, "transformer_engine.jax", parent)
  monkeypatch.setitem(sys.modules, "transformer_engine.jax.attention", fake)
  B, T, N, H = 2, 256, 4, 128  # H = 128, as the GPU test's (2, 1024, 4, 128): 128 ** -0.5 != 1 / sqrt(128)
  q = jnp.zeros((B, T, N, H), jnp.bfloat16)
  wrapper.te_raw(q, q, q, causal)
  call = spec.describe(q, q, q, is_causal=causal)
  te_backend.run(q, q, q, call, te_backend.decide(call))
  raw, ours = seen
  assert ours == raw, (ours, raw)
  assert ours["scaling_factor"] == call.scale == 1.0 / math.sqrt(H)


OUT_MODULES = ["benchmarks.layer", "benchmarks.train", "benchmarks.fp8", "benchmarks.fp8_train", "benchmarks.wrapper",
               "benchmarks.decode", "benchmarks.steady", "benchmarks.summary"]


@pytest.mark.parametrize("module", OUT_MODULES)
@pytest.mark.filterwarnings("ignore:'benchmarks\\..*' found in sys.modules:RuntimeWarning")
def test_an_out_that_cannot_be_written_exits_2_before_any_timing(module, capsys, monkeypatch, tmp_path):
  """Every benchmark with --out checks it first (benchmarks.common.check_out): benchmarks.layer timed for minutes
  and then lost its rows to an --out it could not write."""
  import runpy
  (tmp_path / "file").write_text("x")
  out = str(tmp_path / "file" / "out")
  monkeypatch.setattr(common, "time_fn", lambda *a, **k: pytest.fail("timed a row"))
  monkeypatch.setattr(sys, "argv", [module, "--out", out])
  with pytest.raises(SystemExit) as e:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith(f"error: --out {out} cannot be written: {tmp_path / 'file'} is a "
                                              "file, not a folder; give another --out"), err[-1500:]
  assert len(err.strip().splitlines()) == 1, err[-1500:]


def test_check_out_tries_a_write(tmp_path, capsys, monkeypatch):
  """Permission bits do not say what root may write, nor what a read-only mount refuses: the check writes a file
  (and deletes it) in the nearest folder that exists, and makes nothing else."""
  from train import flags
  p = flags.Parser(prog="python -m benchmarks.x")
  common.check_out(p, str(tmp_path / "a" / "b"))
  assert os.listdir(tmp_path) == []
  def refuse(*a, **k):
    raise PermissionError(13, "Permission denied")
  monkeypatch.setattr(common.tempfile, "mkstemp", refuse)
  with pytest.raises(SystemExit) as e:
    common.check_out(p, str(tmp_path / "a"))
  assert e.value.code == 2 and f"error: --out {tmp_path / 'a'} cannot be written: {tmp_path}: Permission denied; " \
      "give another --out" in capsys.readouterr().err
  (tmp_path / "d").mkdir()
  with pytest.raises(SystemExit):
    common.check_out(p, str(tmp_path / "d"), file=True)
  assert f"--out {tmp_path / 'd'} is a folder; give the file to write" in capsys.readouterr().err


@pytest.mark.parametrize("content, why", [
    (b'{"rows": []}', 'it has no "environment" with matmul_bf16_tflops and no "rows" list'),
    (b"[1, 2]", 'it has no "environment"'),
    (b"not json", "it cannot be read as JSON (Expecting value"),
    (b"\x7fELF\xff\xfe", "it cannot be read as JSON ('utf-8' codec can't decode"),
], ids=["no-environment", "a-list", "text", "binary"])
def test_merge_of_a_file_that_is_not_a_results_file_exits_2_naming_it(content, why, tmp_path, capsys):
  """--merge read any file it was given: json's or a KeyError's traceback, after --out was made."""
  path = tmp_path / "x.json"
  path.write_bytes(content)
  with pytest.raises(SystemExit) as e:
    layer.main(["--merge", str(path), "--out", str(tmp_path / "out")])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.startswith(f"error: --merge: {path} is not a layer.json this benchmark wrote: "
                                              f"{why}"), err[-1500:]
  assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists(), err[-1500:]


def _without_matplotlib(module: str, *argv: str) -> subprocess.CompletedProcess:
  code = (f"import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = [{module!r}, *{list(argv)!r}]; "
          f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("module, argv", [("benchmarks.layer", ["--quick"]), ("benchmarks.decode", ["--quick"]),
                                          ("benchmarks.train", ["--backends", "xla", "--preset", "tiny", "--steps", "2"]),
                                          ("benchmarks.fp8_train", ["--steps", "2"])])
def test_without_matplotlib_a_benchmark_that_plots_says_which_extra_in_one_line(module, argv, tmp_path):
  """Without the bench extra, python -m benchmarks.layer printed two chained tracebacks before the install hint;
  then --help failed too, before it printed the flags."""
  proc = _without_matplotlib(module, *argv, "--out", str(tmp_path / "out"))
  assert proc.returncode == 2, proc.stderr[-1500:]
  assert proc.stderr.strip() == ("error: the benchmarks write plots with matplotlib, which is not installed: "
                                 "pip install 'attnlayers[bench]'"), proc.stderr[-1500:]
  assert not (tmp_path / "out").exists()
  proc = _without_matplotlib(module, "--help")
  assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stderr[-1500:]


def test_no_benchmark_writes_the_published_results_unless_named():
  """Every benchmark's --out defaults outside benchmarks/results: a plain run (or a partial one, such as
  `benchmarks.scaling --no-check`) never replaces a published file."""
  import ast
  import pathlib
  defaults = {}
  for path in sorted(pathlib.Path(ROOT, "benchmarks").glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
          and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--out"):
        kw = {k.arg: k.value for k in node.keywords}
        defaults[path.name] = ast.literal_eval(kw["default"]) if "default" in kw else None
  assert {"layer.py", "decode.py", "scaling.py", "splash_blocks.py", "kernels.py"} <= defaults.keys(), defaults
  published = {name: d for name, d in defaults.items() if d is not None and d.startswith("benchmarks/results")}
  assert not published, published
