"""`python -m benchmarks.layer --quick` on CPU: every output kind, and reasons on unavailable rows."""

import csv
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layer_quick_writes_json_csv_markdown_and_plots(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "benchmarks.layer", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=900)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.load(open(tmp_path / "layer.json"))["rows"]
  assert len(list(csv.DictReader(open(tmp_path / "layer.csv")))) == len(rows)
  assert "## seq" in (tmp_path / "layer.md").read_text()
  assert len(list(tmp_path.glob("*.png"))) >= 5
  sections = {r["section"] for r in rows}
  assert {"default", "seq", "heads", "headdim"} <= sections and any(s.startswith("batch") for s in sections)
  ok = [r for r in rows if r["status"] == "ok"]
  assert ok and all(r["median_ms"] > 0 and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"] and r["tflops"] > 0 for r in ok)
  assert {r["backend"] for r in ok} >= {"naive", "xla"}
  not_ok = [r for r in rows if r["status"] != "ok"]
  assert all(r["reason"] for r in not_ok)  # a backend that cannot run is a row with its reason
  assert {r["backend"] for r in rows} == {"naive", "xla", "cudnn", "te", "te-fp8", "cudnn-raw", "te-raw"}
  default_f32 = [r for r in rows if r["section"] == "default" and r["dtype"] == "float32" and r["pass"] == "fwd"]
  assert all(r["max_abs_diff_vs_naive_f32"] < 1e-5 for r in default_f32)


def test_train_benchmark_writes_rows_for_every_backend(tmp_path):
  cmd = [sys.executable, "-m", "benchmarks.train", "--preset", "tiny", "--backends", "xla", "cudnn", "--steps", "4",
         "--batch-size", "4", "--seq-len", "32", "--matmul-n", "256", "--out", str(tmp_path)]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=900)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = {r["backend"]: r for r in json.load(open(tmp_path / "train.json"))["rows"]}
  assert rows["xla"]["status"] == "ok" and rows["xla"]["tokens_per_s"] > 0 and rows["xla"]["vs_matmul"] > 0
  if rows["cudnn"]["status"] != "ok":
    assert "cuDNN" in rows["cudnn"]["reason"]
  assert (tmp_path / "train.csv").exists() and (tmp_path / "train_T32_tokens_per_s.png").exists()
  assert "| xla |" in (tmp_path / "train.md").read_text()
