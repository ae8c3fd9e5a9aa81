"""`python -m benchmarks.layer --quick` and `benchmarks.train` on CPU: every output kind, rates that
are the formula over the measured time, differences to the reference, reasons on unavailable rows."""

import csv
import json
import os
import subprocess
import sys

import pytest

from benchmarks import layer
from tests import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(module, *args, timeout=900):
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                        env=dict(os.environ, PYTHONPATH=ROOT), timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc


def test_layer_quick_writes_json_csv_markdown_and_plots(tmp_path):
  run("benchmarks.layer", "--quick", "--out", str(tmp_path))
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
  assert {r["backend"] for r in rows} == {"naive", "xla", "cudnn", "te", "te-fp8", "cudnn-raw", "te-raw"}
  default = {(r["level"], r["backend"], r["dtype"]): r for r in rows
             if r["section"] == "default" and r["pass"] == "fwd" and r["status"] == "ok"}
  assert "max_abs_diff_vs_naive_f32" not in default[("core", "naive", "float32")]  # the reference is not compared with itself
  for level in ("core", "layer"):
    xla32 = default[(level, "xla", "float32")]["max_abs_diff_vs_naive_f32"]
    xla16 = default[(level, "xla", "bfloat16")]["max_abs_diff_vs_naive_f32"]
    assert xla32 < reference.TOLERANCES[("float32", "out")][0] * 10, xla32
    assert 0 < xla16 < reference.TOLERANCES[("bfloat16", "out")][0] * 10, xla16  # bf16 rounding shows, within bounds


def test_train_benchmark_writes_rows_for_every_backend(tmp_path):
  run("benchmarks.train", "--preset", "tiny", "--backends", "xla", "cudnn", "--steps", "4", "--batch-size", "4",
      "--seq-len", "32", "--matmul-n", "256", "--out", str(tmp_path))
  result = json.load(open(tmp_path / "train.json"))
  rows, matmul = {r["backend"]: r for r in result["rows"]}, result["environment"]["matmul_bf16_tflops"]
  xla = rows["xla"]
  assert xla["status"] == "ok" and xla["tokens_per_s"] == pytest.approx(xla["steps_per_s"] * 4 * 32)
  assert xla["vs_matmul"] == pytest.approx(xla["model_tflops"] / matmul)
  assert rows["cudnn"]["status"] == "unavailable" and "cuDNN" in rows["cudnn"]["reason"]  # CPU: says why
  assert (tmp_path / "train.csv").exists() and (tmp_path / "train_T32_tokens_per_s.png").exists()
  md = (tmp_path / "train.md").read_text()
  assert "| xla |" in md and "PaLM" in md  # the MFU convention is named beside the table

