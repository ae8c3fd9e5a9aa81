"""The training loop on CPU: learning, data parallelism, kill -9 and resume, divergence, bad input."""

import contextlib
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models import plans
from train import cli, data, loop, report, signals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--no-progress", "--sample-tokens", "0",
         "--eval-every", "0", "--log-every", "1"]


def train_cli(*args, devices: int = 1, wait: bool = True):
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  keep = [] if "--ckpt-dir" in args else ["--no-ckpt"]  # without a folder a run keeps nothing, not runs/train-*
  proc = subprocess.Popen([sys.executable, "-m", "train", *args, *keep], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  if not wait:
    return proc
  out, err = proc.communicate(timeout=600)
  return proc.returncode, out, err


def train_main(*args) -> tuple[int, str, str]:
  """`python -m train ARGS` in this process: the exit code, stdout and stderr. Runs that
  need a process of their own (several devices or processes, signals, kill -9) use train_cli."""
  keep = [] if "--ckpt-dir" in args else ["--no-ckpt"]
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      cli.main([*args, *keep])
      code = 0
    except SystemExit as e:
      code = e.code
  return code, out.getvalue(), err.getvalue()


def losses(path) -> dict[int, float]:
  """step -> loss; a resumed run's later line for a step replaces the earlier one."""
  rows = [json.loads(line) for line in open(path)]
  return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def test_loss_falls_on_tiny(tmp_path):
  cfg = loop.TrainConfig(model=models.preset("tiny", seq_len=64), steps=60, batch_size=8, lr=3e-3, warmup=10,
                         eval_every=60, log_every=1, sample_tokens=20, progress=False,
                         metrics=str(tmp_path / "m.jsonl"))
  summary = loop.run(cfg)
  curve = [loss for _, loss in sorted(losses(tmp_path / "m.jsonl").items())]
  assert len(curve) == 60 and summary["final_loss"] == curve[-1]
  end = curve[-10:]
  # the last 10 steps sit below the first step by far more than they scatter, and below uniform guessing
  assert curve[0] - np.mean(end) > 5 * np.std(end), curve
  assert np.mean(end) < np.log(256), curve
  assert len(summary["sample"]) > 0 and summary["tokens_per_s"] > 0
  model = models.GPT(cfg.model, rngs=nnx.Rngs(0))
  assert summary["params"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))  # biases, norms too
  assert summary["params_for_flops"] == models.count_params(model) < summary["params"]
  assert summary["kernels"] == ("pallas" if jax.default_backend() == "gpu" and jax.device_count() == 1 else "xla")


@pytest.mark.slow
def test_data_parallel_on_4_devices_matches_1(tmp_path):
  for n in (1, 4):
    rc, _, err = train_cli(*SMALL, "--steps", "8", "--metrics", str(tmp_path / f"{n}.jsonl"), devices=n)
    assert rc == 0, err
  one, four = losses(tmp_path / "1.jsonl"), losses(tmp_path / "4.jsonl")
  assert sorted(one) == list(range(1, 9))
  # the same global batch; only the order of the gradient all-reduce differs
  np.testing.assert_allclose([four[s] for s in one], list(one.values()), rtol=2e-5)


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  """Multi-host through jax.distributed.initialize: 2 processes x 2 devices vs 1 process x 4 devices."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  args = [*SMALL, "--steps", "6", "--sample-tokens", "5", "--coordinator-address", f"127.0.0.1:{port}",
          "--num-processes", "2", "--metrics", str(tmp_path / "two.jsonl")]
  procs = [train_cli(*args, "--process-id", str(i), devices=2, wait=False) for i in (0, 1)]
  results = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-1500:] for _, err in results]
  assert "sample:" in results[0][0] and "sample:" not in results[1][0]  # process 0 reports
  rc, _, err = train_cli(*SMALL, "--steps", "6", "--metrics", str(tmp_path / "one.jsonl"), devices=4)
  assert rc == 0, err
  one, two = losses(tmp_path / "one.jsonl"), losses(tmp_path / "two.jsonl")
  assert sorted(two) == list(range(1, 7))
  np.testing.assert_allclose([two[s] for s in one], list(one.values()), rtol=2e-5)


@pytest.mark.slow
def test_processes_given_other_settings_are_refused_before_training(tmp_path):
  """Two processes of one run with another --lr on process 1: both exit 2 before training, each saying which
  process differs and how (they trained in lockstep with different learning rates, or crashed in gloo on a shape)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  args = [*SMALL, "--steps", "4", "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2"]
  procs = [train_cli(*args, "--process-id", str(i), *(["--lr", "1e-4"] if i else []), devices=2, wait=False)
           for i in (0, 1)]
  try:
    results = [p.communicate(timeout=240) for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [2, 2], [err[-1500:] for _, err in results]
  assert "error: process(es) 1 were given other settings than process 0" in results[0][1], results[0][1][-1500:]
  assert "error: process 1 was given other settings than process 0 (lr: 0.003 there, 0.0001 here)" in results[1][1]
  assert "step 1" not in results[0][0] + results[1][0]


@pytest.mark.slow
def test_a_signal_to_one_process_stops_and_saves_every_process(tmp_path):
  """SIGTERM to one process of a two-process run: both stop after the same step, save it together (a save is a
  collective: the other process, had it trained on, would wait for it for ever), say why, and exit 143; the run
  then resumes from that step."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  ckpt, log = tmp_path / "c", tmp_path / "m.jsonl"
  args = [*SMALL, "--steps", "3000", "--ckpt-dir", str(ckpt), "--ckpt-every", "3000", "--metrics", str(log),
          "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2"]
  procs = [train_cli(*args, "--process-id", str(i), devices=2, wait=False) for i in (0, 1)]
  deadline = time.time() + 300
  while time.time() < deadline and all(p.poll() is None for p in procs):
    if log.exists() and max(losses(log), default=0) >= 5:
      break
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)  # process 1 alone
  try:
    results = [p.communicate(timeout=240) for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, [err[-1500:] for _, err in results]
  steps = [int(err.split(" after step ")[1].split(":")[0]) for _, err in results]
  assert steps[0] == steps[1] and 5 <= steps[0] < 3000, steps
  assert f"stopped by SIGTERM (received by another process) after step {steps[0]}: saved step" in results[0][1]
  assert f"stopped by SIGTERM after step {steps[0]}: saved step" in results[1][1]
  rc, out, err = train_cli(*SMALL, "--steps", str(steps[0] + 2), "--ckpt-dir", str(ckpt), "--allow-change", "steps",
                           devices=4)
  assert rc == 0 and f"at step {steps[0]}" in out, err[-1500:]


@pytest.mark.slow
def test_kill_9_then_rerun_resumes_bitwise(tmp_path):
  args = [*SMALL, "--steps", "60", "--ckpt-every", "10"]
  rc, _, err = train_cli(*args, "--ckpt-dir", str(tmp_path / "a"), "--metrics", str(tmp_path / "a.jsonl"))
  assert rc == 0, err
  killed = [*args, "--ckpt-dir", str(tmp_path / "b"), "--metrics", str(tmp_path / "b.jsonl")]
  proc = train_cli(*killed, wait=False)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if (tmp_path / "b.jsonl").exists() and max(losses(tmp_path / "b.jsonl"), default=0) >= 15:
      break
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  reached = max(losses(tmp_path / "b.jsonl"))
  assert proc.returncode == -signal.SIGKILL and 15 <= reached < 60, f"killed at step {reached}"
  rc, out, err = train_cli(*killed)
  assert rc == 0, err
  resumed_at = int(out.split("resumed from")[1].split("at step")[1].split()[0])
  assert 10 <= resumed_at <= reached
  a, b = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
  after = range(resumed_at + 1, 61)
  assert [b[s] for s in after] == [a[s] for s in after]  # bitwise


def test_log_records_wait_for_the_next_step_but_saves_do_not(tmp_path, monkeypatch):
  """A log-only record is written after the next step is dispatched (the device keeps a step queued while the
  host reports); a save's record, and the last step's, before: donation frees the state they read."""
  events = []
  real_build, real_write = loop.build, loop.metrics.MetricsFile.write

  def build(cfg, replicated):
    model, state = real_build(cfg, replicated)
    def train_step(state, batch, step):
      events.append(("step", step))
      return model.train_step(state, batch, step)
    return dataclasses.replace(model, train_step=train_step), state

  def write(self, record):
    if "loss" in record:
      events.append(("record", record["step"]))
    real_write(self, record)

  monkeypatch.setattr(loop, "build", build)
  monkeypatch.setattr(loop.metrics.MetricsFile, "write", write)
  cfg = loop.TrainConfig(model=models.preset("tiny", seq_len=32), steps=8, batch_size=8, eval_every=0, log_every=2,
                         ckpt_every=4, sample_tokens=0, progress=False, ckpt_dir=str(tmp_path / "c"),
                         metrics=str(tmp_path / "m.jsonl"))
  summary = loop.run(cfg)
  assert events == [("step", 1), ("step", 2), ("step", 3), ("record", 2), ("step", 4), ("record", 4), ("step", 5),
                    ("step", 6), ("step", 7), ("record", 6), ("step", 8), ("record", 8)], events
  records = losses(tmp_path / "m.jsonl")
  assert sorted(records) == [2, 4, 6, 8] and summary["final_loss"] == records[8]
  assert all(np.isfinite(list(records.values())))


class _SimulatedLoss:
  """A step's loss on a simulated device that runs one step at a time: ready once the device clock passes `end`."""

  def __init__(self, value, end: float):
    self.value, self.end = value, end

  def is_ready(self) -> bool:
    return time.perf_counter() >= self.end

  def __float__(self) -> float:
    time.sleep(max(0.0, self.end - time.perf_counter()))
    return float(self.value)


@pytest.mark.parametrize("dispatch", ["inline", "mixed"])
def test_rates_count_only_the_steps_that_ran_in_their_interval(tmp_path, monkeypatch, dispatch):
  """On a simulated device that runs each step for 50 ms, one at a time, no reported rate may exceed 20 steps/s,
  at log-only, evaluated and last steps alike: "inline", every dispatch returns once its step has run (as on a
  CPU); "mixed", every other one returns while its step still runs. A report written one step late must count
  the step that ran meanwhile, and never a step that ran before its interval began. The metrics file marks
  where the run begins and ends."""
  real_build, device_free = loop.build, [0.0]

  def build(cfg, replicated):
    model, state = real_build(cfg, replicated)
    def train_step(state, batch, step):
      state, loss = jax.block_until_ready(model.train_step(state, batch, step))
      device_free[0] = max(time.perf_counter(), device_free[0]) + 0.05  # this step's end on the device
      if dispatch == "inline" or step % 2 == 0:
        time.sleep(max(0.0, device_free[0] - time.perf_counter()))
      else:
        time.sleep(0.02)  # the host's own work on the dispatch while the device runs the step
      return state, _SimulatedLoss(loss, device_free[0])
    return dataclasses.replace(model, train_step=train_step), state

  monkeypatch.setattr(loop, "build", build)
  cfg = loop.TrainConfig(model=models.preset("tiny", seq_len=32), steps=24, batch_size=8, warmup=1, eval_every=5,
                         eval_batches=1, log_every=1, sample_tokens=0, progress=False, metrics=str(tmp_path / "m.jsonl"))
  summary = loop.run(cfg)
  rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
  rates = {r["step"]: r["steps_per_s"] for r in rows if "loss" in r and "steps_per_s" in r}
  assert len(rates) >= 8 and max(rates.values()) <= 20 * 1.02, rates  # 1.02: the clock's resolution
  assert summary["steps_per_s"] <= 20 * 1.02
  assert rows[0]["event"] == "start" and rows[0]["from_step"] == 0 and rows[-1] == json.loads(json.dumps(summary))
  assert [r["step"] for r in rows if "loss" in r] == list(range(1, 25))


def test_a_step_that_fails_keeps_the_record_of_the_finished_step_before_it(tmp_path, monkeypatch):
  """The pending log record of step 2 is still written when step 3 raises, and step 3's error is what surfaces."""
  real_build = loop.build

  def build(cfg, replicated):
    model, state = real_build(cfg, replicated)
    last = []
    def train_step(state, batch, step):
      if step == 3:
        jax.block_until_ready(last)  # step 2 has finished (its loss too): its record can be written without waiting
        raise RuntimeError("step 3 failed")
      last[:] = model.train_step(state, batch, step)
      return tuple(last)
    return dataclasses.replace(model, train_step=train_step), state

  monkeypatch.setattr(loop, "build", build)
  cfg = loop.TrainConfig(model=models.preset("tiny", seq_len=32), steps=5, batch_size=8, warmup=1, eval_every=0,
                         log_every=1, sample_tokens=0, progress=False, metrics=str(tmp_path / "m.jsonl"))
  with pytest.raises(RuntimeError, match="step 3 failed"):
    loop.run(cfg)
  assert sorted(losses(tmp_path / "m.jsonl")) == [1, 2]


def _notices_for(**settings) -> list[str]:
  """The lines loop.run prints before any work for a tiny run with these TrainConfig settings."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    report.notices(loop.TrainConfig(model=models.preset("tiny", seq_len=32), sample_tokens=0, **settings))
  return out.getvalue().splitlines()


def test_settings_the_run_cannot_honour_are_announced_and_the_sample_shows_its_prompt(capsys):
  """--warmup past --steps and --sample-tokens past the context run as they can, saying so before any work;
  the end-of-run sample is printed after the prompt it continues."""
  cli.main(["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--steps", "3", "--warmup", "5",
            "--sample-tokens", "200", "--eval-every", "0", "--no-progress", "--no-ckpt"])
  out = capsys.readouterr().out
  assert "warmup 5 is more than steps 3: the warm-up is shortened to 3 steps, so the learning rate rises for the " \
         "whole run, to 3/4 of the peak lr, and never decays" in out, out
  assert "sample_tokens 200: the end-of-run sample has 24 new tokens, what fits in the 32-token context after " \
         "its 8-token prompt" in out, out
  assert out.index("warmup 5") < out.index("done: 3 steps")
  for warmup, notice in ((3, "warmup 3 is as long as the run (3 steps): the learning rate rises for the whole run, "
                              "to 3/4 of the peak lr, and never decays"),
                         (2, "warmup 2 ends at the last of 3 steps: the learning rate reaches its peak there and "
                             "never decays"), (1, None)):
    notices = [line for line in _notices_for(steps=3, warmup=warmup) if line.startswith("warmup")]
    assert notices == ([notice + " (--warmup sets the warm-up)"] if notice else []), notices
  assert "the warm-up is shortened to 1 step, so" in _notices_for(steps=1, warmup=5)[0]  # one step, not "1 steps"
  assert "prompt (the start of the first validation text):\n" in out and out.index("prompt (") < out.index("sample:\n")


def test_rerun_of_a_finished_run_says_nothing_was_trained(tmp_path, capsys):
  args = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--steps", "2", "--warmup", "1",
          "--sample-tokens", "0", "--eval-every", "0", "--no-progress", "--ckpt-dir", str(tmp_path / "c")]
  cli.main(args)
  assert f"model saved in {tmp_path / 'c'} (step 2)" in capsys.readouterr().out
  cli.main(args)
  out = capsys.readouterr().out
  assert "step 2 of 2 is done: nothing to train" in out, out
  assert f"no step to train: the model was saved in {tmp_path / 'c'} (step 2)" in out, out


def test_nan_stops_keeps_last_good_checkpoint_and_records_why(tmp_path):
  ckpt = ["--ckpt-dir", str(tmp_path / "c"), "--ckpt-every", "5"]
  rc, _, err = train_main(*SMALL, "--steps", "10", *ckpt)
  assert rc == 0, err
  rc, _, err = train_main(*SMALL, "--steps", "30", "--lr", "1e30", "--allow-change", "steps", "--allow-change", "lr",
                         "--metrics", str(tmp_path / "m.jsonl"), *ckpt)
  assert rc == 2
  assert "loss is nan at step" in err or "loss is inf at step" in err, err
  assert "the last good checkpoint, step 10" in err and "untouched" in err
  records = [loop.metrics.loads(line) for line in open(tmp_path / "m.jsonl")]
  last = records[-1]  # the metrics file says why the run ended, as it does for a signal's stop
  assert last.keys() == {"event", "step", "loss", "last_good"} and last["event"] == "diverged", records
  assert not np.isfinite(last["loss"]) and last["last_good"] == 10 and 10 < last["step"] <= 30, last
  assert f"loss is {last['loss']} at step {last['step']}" in err, err
  rc, out, err = train_main(*SMALL, "--steps", "12", "--allow-change", "steps", *ckpt)
  assert rc == 0 and "at step 10" in out, err


def test_resume_with_other_model_config_is_an_error(tmp_path):
  ckpt = ["--ckpt-dir", str(tmp_path / "c"), "--ckpt-every", "2"]
  assert train_main(*SMALL, "--steps", "2", *ckpt)[0] == 0
  rc, _, err = train_main(*SMALL, "--steps", "4", "--kv-heads", "4", *ckpt)
  assert rc == 2 and "cannot resume" in err and "model.n_kv_head: checkpoint 2, now 4" in err, err


def test_resume_with_other_backend_is_allowed(tmp_path):
  ckpt = ["--ckpt-dir", str(tmp_path / "c"), "--ckpt-every", "2"]
  assert train_main(*SMALL, "--steps", "2", "--attn", "xla", *ckpt)[0] == 0
  rc, out, err = train_main(*SMALL, "--steps", "4", "--allow-change", "steps", "--attn", "naive", *ckpt)
  assert rc == 0 and "at step 2" in out, err


def _file(name, content: bytes):
  def make(d):
    (d / name).write_bytes(content)
    return str(d / name)
  return make


def _empty_folder(d):
  (d / "e").mkdir()
  return str(d / "e")


def _bad_shard(d):
  (d / "x.bin").write_bytes(np.zeros(300, np.int32).tobytes())
  return str(d / "*.bin")


@pytest.mark.parametrize("make, message", [
    (lambda d: str(d / "missing.txt"), "no such file or folder"),
    (_file("empty.txt", b""), "is empty"),
    (_empty_folder, "empty folder"),
    (_file("short.txt", b"hi"), "too little for --seq-len"),
    (_bad_shard, "not an llm.c token shard: header magic 0, expected 20240520"),
], ids=["missing", "empty-file", "empty-folder", "too-short", "bad-shard"])
def test_bad_data_is_a_clear_error(tmp_path, make, message):
  rc, _, err = train_main(*SMALL, "--steps", "1", "--data", make(tmp_path))
  assert rc == 2 and message in err, err


def test_too_little_data_names_the_held_out_part_and_what_would_fit(tmp_path):
  """A file keeps its last 10% for validation: 1001 bytes hold out 101, too few for a window of 129 + 1."""
  (tmp_path / "a.txt").write_bytes(b"x" * 1001)
  with pytest.raises(ValueError) as e:
    data.load(str(tmp_path / "a.txt"), 128)
  assert "1001 bytes in 1 file(s) is too little for --seq-len 128: validation holds out the last 10% of the bytes, " \
         "101 here, and needs more than 129" in str(e.value), e.value
  assert "Give at least 1291 bytes in all, or --seq-len 99 or less" in str(e.value), e.value
  data.load(str(tmp_path / "a.txt"), 99)  # as it says
  (tmp_path / "a.txt").write_bytes(b"x" * 1291)
  data.load(str(tmp_path / "a.txt"), 128)
  for i in range(10):  # ten files: split by file, the 10th (sorted) held out
    (tmp_path / "d").mkdir(exist_ok=True)
    (tmp_path / "d" / f"{i}.txt").write_bytes(b"x" * (500 if i < 9 else 60))
  with pytest.raises(ValueError, match=r"validation holds out every 10th file \(sorted\), and none is longer than "
                                       r"129 bytes \(the longest has 60\).*Give longer files, or --seq-len 58 or less"):
    data.load(str(tmp_path / "d"), 128)


def test_a_folder_reads_each_file_once_through_links(tmp_path):
  """glob follows links: a linked folder, a linked file and a link back up the tree (a loop, which glob follows
  some 40 levels deep) must not read a file more than once, nor put one file in training and validation both."""
  (tmp_path / "d" / "sub").mkdir(parents=True)
  for i in range(12):
    (tmp_path / "d" / "sub" / f"{i:02d}.txt").write_bytes(bytes([65 + i]) * 200)
  os.symlink(tmp_path / "d" / "sub", tmp_path / "d" / "linked")
  os.symlink(tmp_path / "d" / "sub" / "00.txt", tmp_path / "d" / "file-link")
  os.symlink(tmp_path / "d", tmp_path / "d" / "sub" / "back")
  ds = data.load(str(tmp_path / "d"), 16)
  assert len(ds.files) == 12 and len({os.path.realpath(f) for f in ds.files}) == 12, ds.files
  train, val = {bytes(t[:1]) for t in ds.train}, {bytes(t[:1]) for t in ds.val}
  assert len(train) + len(val) == 12 and not train & val, (train, val)


def write_shard(path, tokens):
  header = np.zeros(256, np.int32)
  header[:3] = (data.SHARD_MAGIC, 1, len(tokens))
  path.write_bytes(header.tobytes() + np.asarray(tokens, np.uint16).tobytes())


def test_token_shards_are_read_and_batches_are_deterministic(tmp_path):
  write_shard(tmp_path / "train_000.bin", np.arange(1000) % 50000)
  write_shard(tmp_path / "val_000.bin", np.arange(500) + 7)
  ds = data.load(str(tmp_path / "*.bin"), 16)
  assert ds.vocab_size == 50257 and len(ds.train) == 1 and len(ds.val) == 1
  x, y = ds.batch("train", 3, 5, 4, 16)
  np.testing.assert_array_equal(y[:, :-1], x[:, 1:])  # targets are inputs shifted by one
  np.testing.assert_array_equal(np.diff(x, axis=1), 1)  # consecutive ids from the arange shard
  np.testing.assert_array_equal(x, ds.batch("train", 3, 5, 4, 16)[0])
  assert not np.array_equal(x, ds.batch("train", 3, 6, 4, 16)[0])


def test_shards_too_short_say_their_lengths_and_the_seq_len_that_fits(tmp_path):
  """A window needs a shard longer than seq_len + 1 tokens (validation always, training unpacked); a packed row needs
  seq_len + 1 tokens of one training shard. The error gives the longest of each and the largest --seq-len that
  works, which then loads, as one more does not."""
  write_shard(tmp_path / "a_train.bin", np.arange(100))
  write_shard(tmp_path / "b_train.bin", np.arange(40))
  write_shard(tmp_path / "c_val.bin", np.arange(50))
  spec = str(tmp_path / "*.bin")
  with pytest.raises(ValueError) as e:
    data.load(spec, 64)
  assert str(e.value) == (f"--data {spec!r}: shards too short for --seq-len 64: a window needs a shard of more than "
                          "65 tokens, and the longest training shard has 100 tokens, the longest validation shard 50. "
                          "Give longer shards, or --seq-len 48 or less"), e.value
  data.load(spec, 48)  # as it says
  with pytest.raises(ValueError, match="or --seq-len 48 or less"):
    data.load(spec, 49)
  write_shard(tmp_path / "a_train.bin", np.arange(30))  # packed: a row of 31 + 1 tokens needs the 40-token shard
  write_shard(tmp_path / "c_val.bin", np.arange(300))
  with pytest.raises(ValueError) as e:
    data.load(spec, 64, pack=True)
  assert "a window needs a shard of more than 65 tokens (validation's; packed training needs 65 tokens in one " \
         "training shard), and the longest training shard has 40 tokens, the longest validation shard 300. Give " \
         "longer shards, or --seq-len 39 or less" in str(e.value), e.value
  assert data.load(spec, 39, pack=True).packed.n_rows == 1
  with pytest.raises(ValueError, match="or --seq-len 39 or less"):
    data.load(spec, 40, pack=True)


def test_a_folder_of_token_shards_is_refused_naming_the_pattern_that_reads_them(tmp_path):
  """--data DIR reads a folder as text: llm.c shards there were trained on as bytes (header and uint16 halves).
  Refused, alone or beside text, with the quoted pattern that reads them as GPT-2 tokens; a .bin without the
  shard magic is text."""
  d = tmp_path / "d"
  d.mkdir()
  write_shard(d / "a_train.bin", np.arange(300))
  write_shard(d / "b_val.bin", np.arange(300))
  with pytest.raises(ValueError) as e:
    data.load(str(d), 16)
  assert f"--data {str(d)!r} holds 2 llm.c token shard(s): a folder is read as text" in str(e.value), e.value
  assert f"give the quoted pattern --data '{d}/*.bin'" in str(e.value), e.value
  assert "without the shards" not in str(e.value)
  (d / "notes.txt").write_bytes(b"x" * 300)
  with pytest.raises(ValueError, match=r"holds 2 llm.c token shard\(s\) beside 1 other file\(s\).*; for the "
                                       r"text, a folder without the shards"):
    data.load(str(d), 16)
  assert len(data.load(str(d / "*.bin"), 16).train) == 1  # as it says
  t = tmp_path / "t"
  t.mkdir()
  (t / "notes.txt").write_bytes(b"x" * 300)
  (t / "table.bin").write_bytes(b"y" * 300)  # no magic: text
  assert data.load(str(t), 16).files == (str(t / "notes.txt"), str(t / "table.bin"))


def test_stdlib_corpus_is_split_by_file():
  ds = data.load(None, 128)
  assert len(ds.train) > 50 and len(ds.val) > 5 and ds.vocab_size == 256
  assert not any(v is t for v in ds.val for t in ds.train)


def test_a_prompt_from_a_file_cut_for_validation_starts_at_a_line(tmp_path, capsys):
  """A single file keeps its last 10% for validation, cut at a byte count: the end-of-run sample's prompt
  starts after the first newline there, not mid-word; the stdlib split (whole held-out files) starts at 0."""
  text = "".join(f"line number {i} of the file\n" for i in range(200)).encode()
  (tmp_path / "t.txt").write_bytes(text)
  ds = data.load(str(tmp_path / "t.txt"), 32)
  cut = int(len(text) * 0.9)
  assert text[cut - 1:cut] != b"\n" and ds.prompt_start > 0  # the cut fell mid-line
  assert bytes(ds.val[0][ds.prompt_start:]).startswith(b"line number ") and ds.val[0][ds.prompt_start - 1] == 10
  assert data.load(None, 128).prompt_start == 0
  cli.main(["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--steps", "1", "--data", str(tmp_path / "t.txt"),
            "--sample-tokens", "4", "--eval-every", "0", "--no-progress", "--no-ckpt"])
  assert "prompt (the start of the first validation text):\nline number " in capsys.readouterr().out


def test_a_signal_after_the_last_step_skips_the_sample_and_exits_as_a_stop(tmp_path, monkeypatch):
  """SIGTERM while the summary is made (after the last step was saved): no end-of-run sample, the summary is
  still written, and the run ends as stopped (exit code 128 + signal), not as a finished run."""
  real = report.summary
  def summary(s, *args):
    s.stop.received = signal.SIGTERM  # as the handler records it
    return real(s, *args)
  monkeypatch.setattr(report, "summary", summary)
  monkeypatch.setattr(report, "_sample", lambda *a: pytest.fail("sampled after the signal"))
  cfg = loop.TrainConfig(model=models.preset("tiny", seq_len=32), steps=2, batch_size=4, warmup=1, eval_every=0,
                         sample_tokens=8, progress=False, ckpt_dir=str(tmp_path / "c"),
                         metrics=str(tmp_path / "m.jsonl"))
  with pytest.raises(signals.Stopped, match="stopped by SIGTERM at the end of the run, after step 2: saved in") as e:
    loop.run(cfg)
  assert e.value.exit_code == 128 + signal.SIGTERM and os.path.isdir(tmp_path / "c" / "2")
  assert json.loads(open(tmp_path / "m.jsonl").readlines()[-1])["event"] == "summary"


def test_a_run_plans_its_attention_once_and_its_summary_reports_those_plans(monkeypatch):
  """loop.run makes the attention plans once (the check before any work), and the summary's attention_ran and
  attention_notes are of those plans, not of plans made again."""
  made = []
  real = report.attention_plans
  monkeypatch.setattr(report, "attention_plans", lambda *a, **k: made.append(a) or real(*a, **k))
  cfg = loop.TrainConfig(model=models.preset("tiny", seq_len=32), steps=1, batch_size=4, warmup=0, eval_every=0,
                         sample_tokens=0, progress=False)
  summary = loop.run(cfg)
  assert len(made) == 1, made
  again = real(cfg.model, cfg.batch_size, cfg.pack)
  assert summary["attention_ran"] == plans.ran(again) and summary["attention_notes"] == plans.notes(again)


def _fp8_state():
  """The FP8 scaling state of a te-fp8 layer (built here without running it), made distinct."""
  from attnlayers.fp8 import FP8Meta
  from attnlayers.nnx import MultiHeadAttention
  layer = MultiHeadAttention(2, 16, backend="te-fp8", decode=False, rngs=nnx.Rngs(0))
  state = nnx.state(layer, FP8Meta)
  return jax.tree.map(lambda x: x + jnp.arange(x.size, dtype=x.dtype).reshape(x.shape), state)


def test_checkpoint_keeps_fp8_state_and_survives_backend_switches(tmp_path):
  from train.checkpoint import Checkpoints
  params = {"w": jnp.ones((3,))}
  fp8 = _fp8_state()
  ckpts = Checkpoints(str(tmp_path / "a"))
  ckpts.save(1, {"params": params, "fp8": fp8}, {"seed": 0})
  restored = ckpts.restore(1, {"params": params, "fp8": jax.tree.map(jnp.zeros_like, fp8)})
  jax.tree.map(np.testing.assert_array_equal, restored["fp8"], fp8)  # the FP8 state comes back exactly
  switched = ckpts.restore(1, {"params": params, "fp8": {}})  # te-fp8 -> a bf16 backend
  assert switched["fp8"] == {} and np.array_equal(switched["params"]["w"], params["w"])
  ckpts.close()
  plain = Checkpoints(str(tmp_path / "b"))
  plain.save(1, {"params": params, "fp8": {}}, {"seed": 0})  # a bf16 run: no FP8 item is written
  fresh = jax.tree.map(jnp.zeros_like, fp8)
  restored = plain.restore(1, {"params": params, "fp8": fresh})  # bf16 -> te-fp8
  jax.tree.map(np.testing.assert_array_equal, restored["fp8"], fresh)  # starts afresh
  plain.close()


def test_checkpoint_from_before_the_fp8_core_history_restores_the_rest_and_starts_it_afresh(tmp_path, capsys):
  from flax import nnx

  from attnlayers.fp8 import FP8Meta
  from attnlayers.nnx import MultiHeadAttention
  from train.checkpoint import Checkpoints
  layer = MultiHeadAttention(2, 16, backend="te-fp8", decode=False, rngs=nnx.Rngs(0))
  layer.fp8_core = None  # the FP8 state an earlier te-fp8 layer kept: its GEMMs' only
  distinct = lambda state: jax.tree.map(lambda x: x + jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) + 1, state)
  old = distinct(nnx.state(layer, FP8Meta))
  params = {"w": jnp.ones((3,))}
  ckpts = Checkpoints(str(tmp_path / "a"))
  ckpts.save(1, {"params": params, "fp8": old}, {"seed": 0})
  fresh = jax.tree.map(jnp.zeros_like, _fp8_state())  # today's te-fp8 layer: one more array, fp8_core
  restored = ckpts.restore(1, {"params": params, "fp8": fresh})
  ckpts.close()
  assert "no FP8 scaling state for fp8_core.value" in capsys.readouterr().err
  np.testing.assert_array_equal(restored["fp8"]["fp8_core"][...], fresh["fp8_core"][...])  # afresh
  del restored["fp8"]["fp8_core"]
  jax.tree.map(np.testing.assert_array_equal, restored["fp8"], old)  # the rest exactly as saved


def test_metrics_lines_are_strict_json_and_keep_non_finite_values(tmp_path):
  f = loop.metrics.MetricsFile(str(tmp_path / "m.jsonl"))
  f.write({"step": 3, "loss": 2.5, "val_loss": float("nan"), "rates": [float("inf"), -float("inf"), 1.0]})
  f.close()
  refuse = lambda name: pytest.fail(f"not strict JSON: {name}")
  record = json.loads((tmp_path / "m.jsonl").read_text(), parse_constant=refuse)
  assert record["loss"] == 2.5 and np.isnan(float(record["val_loss"]))
  assert [float(r) for r in record["rates"]] == [float("inf"), -float("inf"), 1.0]
  back = loop.metrics.loads(loop.metrics.dumps({"final_val_loss": -float("inf"), "sample": "NaN",
                                                 "nested": {"mfu": float("nan")}}))
  assert back["final_val_loss"] == -float("inf") and np.isnan(back["nested"]["mfu"]) and back["sample"] == "NaN"
