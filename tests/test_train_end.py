"""What a finished python -m train run prints at its end, and a Ctrl-C while it does (on CPU)."""

import json
import os
import signal

import pytest

from train import cli, rundirs

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--steps", "2", "--no-progress",
        "--sample-tokens", "0", "--eval-every", "0", "--log-every", "1"]


@pytest.fixture
def text(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "d.txt").write_text("hello world, a small text to train on\n" * 300)
  return str(tmp_path / "d.txt")


def test_the_terminal_shows_a_model_line_and_a_summary_line_and_the_metrics_file_the_whole_summary(text, tmp_path,
                                                                                                     capsys):
  cli.main([*TINY, "--data", text, "--metrics", str(tmp_path / "m.jsonl")])
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[0] == ("model: tiny, 2 layers, 4 heads (2 kv), d_model 128, seq_len 32, vocab 256, attn auto, "
                      "float32"), lines
  assert lines[-1].startswith("done: 2 steps, loss ") and lines[-1].endswith(
      f" parameters (the full summary is in {tmp_path / 'm.jsonl'})"), lines
  assert not any("GPTConfig(" in line or line.startswith("{") for line in lines), lines
  summary = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
  assert summary["event"] == "summary" and summary["steps"] == 2 and f"{summary['params']:,} parameters" in lines[-1]


def test_the_summary_line_says_what_mfu_divides_by(text, tmp_path, capsys):
  cli.main([*TINY, "--data", text, "--metrics", str(tmp_path / "m.jsonl"), "--peak-tflops", "2"])
  done = capsys.readouterr().out.strip().splitlines()[-1]
  assert " of 2 TFLOP/s (--peak-tflops)," in done, done
  summary = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
  assert (summary["mfu_peak_tflops"], summary["mfu_peak"]) == (2.0, "--peak-tflops")


def test_sigint_while_the_end_is_printed_exits_130_without_a_traceback(text, tmp_path, capsys, monkeypatch):
  """A Ctrl-C after the last step, while the sample command is printed (the run's signal handlers are gone by
  then): exit code 130 and one line, and runs/latest already names the run."""
  real = cli._sample_command
  def interrupted(*args):
    os.kill(os.getpid(), signal.SIGINT)  # Python's own handler raises KeyboardInterrupt at the next line
    return real(*args)
  monkeypatch.setattr(cli, "_sample_command", interrupted)
  try:
    cli.main([*TINY, "--data", text])
  except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt escaping is the failure this test looks for
    ended = e
  err = capsys.readouterr().err
  assert isinstance(ended, SystemExit) and ended.code == 130, (ended, err)
  run = os.path.join(rundirs.RUNS, open(tmp_path / rundirs.LATEST).read().strip())
  assert err.strip().splitlines()[-1] == f"stopped by SIGINT after the run ended; the model is saved in {run}", err
  assert "Traceback" not in err
