"""Fault injection for `python -m train` on CPU: damaged checkpoints, foreign folders, a second
trainer, signals, bad flags and changed settings.

Runs are tiny (preset tiny, T=32, B=8). Checkpoint faults run in-process; signals and locks
need processes of their own, which share compiled programs through a persistent
compilation cache so that each pays only python's start and jax's import.
"""

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from train import checkpoint, cli, config, data, lock, loop, optim, overlap, signals, stepdirs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--no-progress", "--sample-tokens", "0",
        "--eval-every", "0", "--log-every", "1"]


def tiny(ckpt_dir, **overrides) -> loop.TrainConfig:
  """The in-process twin of TINY + --steps 20 --ckpt-every 10: checkpoints at 10 and 20."""
  return loop.TrainConfig(**{"model": models.preset("tiny", seq_len=32), "steps": 20, "batch_size": 8,
                             "ckpt_every": 10, "eval_every": 0, "log_every": 1, "sample_tokens": 0,
                             "progress": False, "ckpt_dir": str(ckpt_dir)} | overrides)


def losses(path) -> dict[int, float]:
  """step -> loss; a resumed run's later line for a step replaces the earlier one."""
  rows = [json.loads(line) for line in open(path)]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def popen(args: list[str], *, cpu: bool = True) -> subprocess.Popen:
  """`python args` from the repository root; on one CPU device where `cpu`, else where jax finds a device."""
  # os.environ carries tests/conftest.py's compilation cache to the child
  env = dict(os.environ, PYTHONPATH=ROOT)
  if cpu:
    env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  # A child inherits an ignored SIGINT (a test runner started in the background has one), but
  # not a handler: with one installed here, the child gets SIGINT as a terminal would send it.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
  finally:
    signal.signal(signal.SIGINT, previous)


def train_cli(args: list[str], *, cpu: bool = True) -> tuple[int, str, str]:
  proc = popen(["-m", "train", *args], cpu=cpu)
  out, err = proc.communicate(timeout=600)
  return proc.returncode, out, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A checkpoint folder with steps 10 and 20, and the run's loss at step 20."""
  d = tmp_path_factory.mktemp("saved") / "ckpt"
  return d, loop.run(tiny(d))["final_loss"]


@pytest.fixture
def ckpt(saved, tmp_path):
  shutil.copytree(saved[0], tmp_path / "ckpt")
  return tmp_path / "ckpt"


# --- damaged checkpoints: the damaged step is set aside, the previous one restored, training goes on


def _largest_state_file(step_dir) -> str:
  return max((f for f in glob.glob(str(step_dir / "state" / "**"), recursive=True) if os.path.isfile(f)),
             key=os.path.getsize)


def flip_bit(step_dir):
  path = _largest_state_file(step_dir)
  raw = bytearray(open(path, "rb").read())
  raw[len(raw) // 2] ^= 0x10
  open(path, "wb").write(bytes(raw))
  return path


def random_bytes(step_dir):
  path = _largest_state_file(step_dir)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    f.write(np.random.default_rng(0).bytes(64))
  return path


def truncate(step_dir):
  path = _largest_state_file(step_dir)
  os.truncate(path, os.path.getsize(path) // 2)
  return path


def remove_state(step_dir):
  shutil.rmtree(step_dir / "state")
  return str(step_dir / "state")


def empty_folder(step_dir):
  shutil.rmtree(step_dir)
  step_dir.mkdir()
  return str(step_dir / stepdirs.MANIFEST)


def damage_orbax_metadata(step_dir):
  (step_dir / "state" / "_METADATA").write_text('{"tree_metadata": {')
  return str(step_dir / "state" / "_METADATA")


def damage_meta_json(step_dir):
  (step_dir / "meta" / "metadata").write_text('{"model": {"vocab_size": 25')
  return str(step_dir / "meta" / "metadata")


def copy_of_another_step(step_dir):
  """Step 10 copied in under step 20's name: intact files, the wrong step."""
  shutil.rmtree(step_dir)
  shutil.copytree(step_dir.parent / "10", step_dir)
  return f"{step_dir / stepdirs.MANIFEST} records step 10, but the folder is named 20"


def added_file(step_dir):
  (step_dir / "state" / "extra").write_bytes(b"x")
  return f"{step_dir / 'state' / 'extra'} is not in {stepdirs.MANIFEST}"


@pytest.mark.parametrize("damage", [flip_bit, random_bytes, truncate, remove_state, empty_folder,
                                    damage_orbax_metadata, damage_meta_json, copy_of_another_step, added_file],
                         ids=["flipped-bit", "64-random-bytes", "truncated-data-file", "missing-state-folder",
                              "empty-step-folder", "damaged-_METADATA", "damaged-meta-json", "copy-of-step-10",
                              "added-file"])
def test_damaged_newest_step_is_set_aside_and_the_previous_restored(ckpt, saved, damage, capsys):
  damaged_file = damage(ckpt / "20")
  summary = loop.run(tiny(ckpt))
  out, err = capsys.readouterr()
  assert f"checkpoint step 20 is damaged: {damaged_file}" in err, err
  assert f"set aside as {ckpt / '20.corrupt-1'}" in err, err
  assert f"resumed from {ckpt} at step 10, the newest checkpoint that verifies" in out, out
  assert summary["final_loss"] == saved[1]  # steps 11-20 again, bit for bit
  assert (ckpt / "20.corrupt-1").is_dir()  # kept for a person to look at, not deleted
  assert stepdirs.problem(str(ckpt / "20")) is None  # and step 20 saved anew


# --- folders that are not ours


def test_foreign_folders_survive_rotation(ckpt, capsys):
  (ckpt / "7").mkdir()
  (ckpt / "7" / "notes.txt").write_text("notes")
  (ckpt / "100").mkdir()
  (ckpt / "100" / "notes.txt").write_text("beyond this run's steps")
  (ckpt / "20.corrupt-1").mkdir()  # set aside by an earlier run
  (ckpt / "007").mkdir()  # not a step's name (steps are canonical decimals): neither step 7 nor in the way
  loop.run(tiny(ckpt, steps=40, allow_change=("steps",)))  # saves 30 and 40; keeps 3 of ours
  assert sorted(os.listdir(ckpt)) == ["007", "100", "20", "20.corrupt-1", "30", "40", "7", "attnlayers.lock"]
  assert (ckpt / "7" / "notes.txt").read_text() == "notes"
  assert f"{ckpt / '7'} has no attnlayers.json: not a checkpoint this program wrote" in capsys.readouterr().err


def test_foreign_folder_where_a_step_would_be_saved_is_refused(ckpt):
  (ckpt / "30").mkdir()
  (ckpt / "30" / "notes.txt").write_text("notes")
  with pytest.raises(checkpoint.CheckpointError,
                     match="where this run would save steps, without attnlayers.json: .*/30\\. Move"):
    loop.run(tiny(ckpt, steps=40, allow_change=("steps",)))
  assert (ckpt / "30" / "notes.txt").read_text() == "notes"


@pytest.mark.parametrize("name, is_file", [("30", True), ("30.saving", True), ("30.saving", False)])
def test_a_file_or_saving_folder_where_a_step_would_be_saved_is_refused_before_training(ckpt, monkeypatch, name,
                                                                                        is_file):
  """orbax's save deletes whatever sits at <step>.saving: a user's file or folder there stops the run at once."""
  path = ckpt / name
  path.write_text("notes") if is_file else (path.mkdir(), (path / "notes.txt").write_text("notes"))
  monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("built a model before refusing"))
  with pytest.raises(checkpoint.CheckpointError, match=f"without attnlayers.json: {path}\\. Move"):
    loop.run(tiny(ckpt, steps=40, allow_change=("steps",)))
  assert (path if is_file else path / "notes.txt").read_text() == "notes"


def test_a_save_stopped_inside_orbax_is_removed_on_the_next_start(tmp_path, capsys):
  """Checkpoints.save names the step in the journal before orbax writes: a save killed part-way leaves
  <step>.saving, which the next start removes as its own."""
  ckpts = checkpoint.Checkpoints(str(tmp_path / "c"))
  def killed(path, **_):
    os.makedirs(os.path.join(path, "state"))
    raise KeyboardInterrupt  # as a save stopped in the middle of orbax's write (killed, or failed)
  ckpts.checkpointer.save = killed
  with pytest.raises(KeyboardInterrupt):
    ckpts.save(10, {"params": {"w": jnp.zeros(2)}}, {})
  ckpts.close()
  assert sorted(os.listdir(tmp_path / "c")) == sorted(["10.saving", stepdirs.JOURNAL, "attnlayers.lock"])
  checkpoint.Checkpoints(str(tmp_path / "c")).close()
  assert f"removed {tmp_path / 'c' / '10.saving'}: a save of this program that was stopped" in capsys.readouterr().err
  assert sorted(os.listdir(tmp_path / "c")) == ["attnlayers.lock"]


def test_only_the_stopped_save_the_journal_names_is_removed(ckpt, capsys):
  """A save stopped mid-way leaves <step>.saving (and orbax's temporary folder) and the journal naming the step:
  those go; a <step>.saving... folder the journal does not name is a user's, and stays."""
  for name in ("30.saving", "30.saving.orbax-checkpoint-tmp-1733", "5.saving", "3.saving.bak"):
    (ckpt / name).mkdir()
    (ckpt / name / "data").write_text("x")
  (ckpt / stepdirs.JOURNAL).write_text("30\n")
  loop.run(tiny(ckpt, steps=40, allow_change=("steps",)))
  err = capsys.readouterr().err
  assert sorted(os.listdir(ckpt)) == ["20", "3.saving.bak", "30", "40", "5.saving", "attnlayers.lock"]
  assert f"removed {ckpt / '30.saving'}: a save of this program that was stopped" in err
  assert f"{ckpt / '5.saving'} is not a save {stepdirs.JOURNAL} names: it is left alone" in err


def test_fresh_run_refuses_a_foreign_folder_where_it_would_save_before_training(tmp_path, monkeypatch):
  (tmp_path / "c" / "20").mkdir(parents=True)
  (tmp_path / "c" / "20" / "notes.txt").write_text("notes")
  monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("built a model before refusing"))
  with pytest.raises(checkpoint.CheckpointError,
                     match="where this run would save steps, without attnlayers.json: .*/20\\. Move"):
    loop.run(tiny(tmp_path / "c", steps=20))
  assert (tmp_path / "c" / "20" / "notes.txt").read_text() == "notes"


def test_missing_data_is_refused_before_the_checkpoint_folder_is_touched(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such file or folder"):
    loop.run(tiny(tmp_path / "c", data=str(tmp_path / "missing.txt")))
  assert not (tmp_path / "c").exists()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the Pallas kernels compile on a GPU: nothing to refuse")
def test_pallas_kernels_off_a_gpu_are_refused_before_the_checkpoint_folder_is_touched(tmp_path):
  with pytest.raises(ValueError, match=r"kernel='pallas': the Pallas kernels need a GPU"):
    loop.run(tiny(tmp_path / "c", model=models.preset("tiny", seq_len=32, kernels="pallas")))
  assert not (tmp_path / "c").exists()


# --- one trainer per folder

HOLD_LOCK = ("import sys, time\nfrom train.lock import DirLock\nDirLock(sys.argv[1]).acquire()\n"
             "print('locked', flush=True)\ntime.sleep(600)")


def _holder(directory) -> subprocess.Popen:
  os.makedirs(directory, exist_ok=True)
  proc = popen(["-c", HOLD_LOCK, str(directory)])
  assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
  return proc


def test_a_trainer_refused_the_lock_leaves_the_holders_new_folder_alone(tmp_path, monkeypatch):
  """Two runs given one new --ckpt-dir: the one that made it holds it; the other, refused its lock, neither
  removes the folder nor the holder's lock (both had seen no folder there before they started)."""
  holder = checkpoint.Checkpoints(str(tmp_path / "new"))
  try:
    assert holder.made
    monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("built a model without the lock"))
    with pytest.raises(lock.LockedError, match="in use by another trainer"):
      loop.run(tiny(tmp_path / "new"))
    assert sorted(os.listdir(tmp_path / "new")) == ["attnlayers.lock"]
  finally:
    holder.close()
  mine = tmp_path / "mine"
  mine.mkdir()  # a folder that existed stays even when the run fails before saving (without the lock it made)
  with pytest.raises(ValueError, match="vocab"):
    loop.run(tiny(mine, model=models.preset("tiny", seq_len=32, vocab_size=100)))
  assert os.listdir(mine) == []
  with pytest.raises(ValueError, match="vocab"):  # and one it made goes
    loop.run(tiny(tmp_path / "made", model=models.preset("tiny", seq_len=32, vocab_size=100)))
  assert not (tmp_path / "made").exists()


@pytest.mark.slow
def test_second_trainer_is_refused_naming_the_holder(tmp_path, capsys):
  holder = _holder(tmp_path / "c")
  try:
    with pytest.raises(SystemExit) as e:
      cli.main([*TINY, "--steps", "5", "--ckpt-dir", str(tmp_path / "c")])
  finally:
    holder.kill()
    holder.communicate()
  err = capsys.readouterr().err
  assert e.value.code == 2
  assert f"is in use by another trainer (pid {holder.pid} on host {socket.gethostname()}" in err, err


@pytest.mark.slow
def test_lock_of_a_killed_trainer_is_taken_over(tmp_path, capsys):
  holder = _holder(tmp_path / "c")
  holder.send_signal(signal.SIGKILL)
  holder.communicate()
  ckpts = checkpoint.Checkpoints(str(tmp_path / "c"))
  ckpts.close()
  assert f"took over {tmp_path / 'c' / 'attnlayers.lock'} from a trainer that did not release it " \
         f"(pid {holder.pid} on host {socket.gethostname()}" in capsys.readouterr().err
  assert (tmp_path / "c" / "attnlayers.lock").read_text() == ""  # a clean exit leaves no name


# --- signals: finish the step, save it, exit 128 + signum; the resumed run is bit for bit the same

SIGNAL_RUN = [*TINY, "--steps", "60", "--ckpt-every", "50"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  d = tmp_path_factory.mktemp("uninterrupted")
  rc, _, err = train_cli([*SIGNAL_RUN, "--ckpt-dir", str(d / "c"), "--metrics", str(d / "m.jsonl")])
  assert rc == 0, err
  return losses(d / "m.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_the_step_and_resume_is_bitwise(tmp_path, uninterrupted, signum):
  args = [*SIGNAL_RUN, "--ckpt-dir", str(tmp_path / "c"), "--metrics", str(tmp_path / "m.jsonl")]
  proc = popen(["-m", "train", *args])
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if (tmp_path / "m.jsonl").exists() and max(losses(tmp_path / "m.jsonl"), default=0) >= 3:
      break
    time.sleep(0.02)
  proc.send_signal(signum)
  _, err = proc.communicate(timeout=300)
  stopped = max(losses(tmp_path / "m.jsonl"))  # the last step it finished
  assert proc.returncode == 128 + signum, err
  assert 3 <= stopped < 60 and "Traceback" not in err, err
  name = signal.Signals(signum).name
  assert f"stopped by {name} after step {stopped}: saved step {stopped} in {tmp_path / 'c'}" in err, err
  assert stepdirs.problem(str(tmp_path / "c" / str(stopped))) is None
  records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
  assert records[-1] == {"event": "stopped", "step": stopped, "signal": name, "saved": True}
  rc, out, err = train_cli(args)
  assert rc == 0 and f"resumed from {tmp_path / 'c'} at step {stopped}" in out, err
  resumed = losses(tmp_path / "m.jsonl")
  assert [resumed[s] for s in range(1, 61)] == [uninterrupted[s] for s in range(1, 61)]  # bitwise


# A run whose save of a step waits, after orbax has written it and before it is sealed, for the file argv[1] + ".go";
# it first writes argv[1] (the step) so the test knows the save is under way.
SLOW_SAVE = ("import os, sys, time\nfrom train import cli, stepdirs\nreal = stepdirs.finish\n"
             "def finish(directory, step):\n  open(sys.argv[1], 'w').write(str(step))\n"
             "  while not os.path.exists(sys.argv[1] + '.go'):\n    time.sleep(0.01)\n"
             "  time.sleep(0.5)  # the test's signal is handled before the save goes on\n"
             "  real(directory, step)\nstepdirs.finish = finish\ncli.main(sys.argv[2:])")


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGTERM),
                                           (signal.SIGINT, signal.SIGTERM)],
                         ids=["SIGINT-SIGINT", "SIGTERM-SIGTERM", "SIGINT-SIGTERM"])
def test_a_second_signal_during_the_save_lets_it_finish_then_exits(tmp_path, first, second):
  """Double Ctrl-C: the first signal stops the run at the step's end, which saves it; the second arrives while that
  save is being written. The save completes and is sealed, then the run exits with the second signal's code."""
  marker = tmp_path / "saving"
  args = [*SIGNAL_RUN, "--ckpt-dir", str(tmp_path / "c"), "--metrics", str(tmp_path / "m.jsonl")]
  proc = popen(["-c", SLOW_SAVE, str(marker), *args])
  try:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and max(losses_or_none(tmp_path / "m.jsonl"), default=0) < 3:
      time.sleep(0.02)
    proc.send_signal(first)
    while time.time() < deadline and proc.poll() is None and not marker.exists():
      time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(second)
    (tmp_path / "saving.go").touch()
    _, err = proc.communicate(timeout=300)
  finally:
    proc.kill()
  step = int(marker.read_text())
  name = signal.Signals(second).name
  assert proc.returncode == 128 + second and "Traceback" not in err, err
  assert f"{name} while a checkpoint is being written: the save finishes, then the run stops" in err, err
  assert f"stopped by {name} after step {step}: saved step {step} in {tmp_path / 'c'}" in err, err
  assert stepdirs.problem(str(tmp_path / "c" / str(step))) is None  # whole and sealed
  assert sorted(os.listdir(tmp_path / "c")) == [str(step), "attnlayers.lock"]  # no .saving left, no journal
  records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
  assert records[-1] == {"event": "stopped", "step": step, "signal": name, "saved": True}


def test_a_second_signal_outside_a_save_stops_at_once_and_one_during_a_save_is_held(capfd):
  """The first SIGINT is recorded; a second one inside saving() is held (the save goes on), one outside it
  gets SIGINT's usual handling: KeyboardInterrupt."""
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's process has it
  try:
    with signals.StopRequests() as stop:
      signal.raise_signal(signal.SIGINT)
      assert (stop.received, stop.held, stop.ending) == (signal.SIGINT, None, signal.SIGINT)
      with stop.saving():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)  # a third: held too, the last one counts
      assert (stop.received, stop.held, stop.ending, stop.name) == (signal.SIGINT, signal.SIGINT, signal.SIGINT,
                                                                    "SIGINT")
      said = capfd.readouterr().err
      assert "SIGTERM while a checkpoint is being written: the save finishes, then the run stops" in said, said
      with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored on the second signal
  finally:
    signal.signal(signal.SIGINT, previous)


def _signal_while_loading(monkeypatch, signum) -> dict:
  """data.load sends `signum` to this process, then takes 3 s more (a large --data); the dict says whether it
  got to its end. Building the model fails the test: a signal before the first step stops the run before it."""
  state = {"finished": False}
  real = data.load
  def load(*args, **kwargs):
    signal.raise_signal(signum)
    time.sleep(3)
    state["finished"] = True
    return real(*args, **kwargs)
  monkeypatch.setattr(data, "load", load)
  monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("built the model after the signal"))
  return state


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("folder", [[], ["--ckpt-dir", "new/c"]], ids=["runs-folder", "new-ckpt-dir"])
def test_a_signal_while_the_data_loads_stops_there_and_removes_what_the_run_made(tmp_path, monkeypatch, capsys,
                                                                                signum, folder):
  """SIGINT/SIGTERM while the data loads, before any step: the loading stops there (it only reads), nothing is
  built or compiled, the run folder, its lock file and the metrics file this run made are removed again, as for a
  refused run (a run that never trained leaves no folder to resume from, and no runs/latest), and it exits
  128 + signum saying so."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "a.txt").write_text("x = 1\n" * 300)
  loading = _signal_while_loading(monkeypatch, signum)
  with pytest.raises(SystemExit) as e:
    cli.main([*TINY, "--steps", "2", "--data", "a.txt", "--metrics", "m.jsonl", *folder])
  err = capsys.readouterr().err
  name = signal.Signals(signum).name
  assert e.value.code == 128 + signum and not loading["finished"], err
  assert (f"stopped by {name} while the data loaded (the loading stopped there), before any step: nothing was "
          "built or compiled, nothing to save\nremoved what this run had made and not used: m.jsonl, ") in err, err
  made = tmp_path / ("new" if folder else "runs")
  assert f", {made}\n" in err and lock.LOCK_NAME in err, err
  assert sorted(os.listdir(tmp_path)) == ["a.txt"]  # no runs/ (nor runs/latest), no new/, no m.jsonl


def test_a_signal_while_the_data_loads_leaves_a_resumable_folder_and_its_metrics_as_they_were(ckpt, tmp_path,
                                                                                             monkeypatch):
  """The same signal with --ckpt-dir holding checkpoints and a metrics file already there: both stay exactly as
  they were (no record is written: the run never began), and the stop names no step."""
  (tmp_path / "m.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
  before = sorted(os.listdir(ckpt)), open(ckpt / lock.LOCK_NAME).read()
  loading = _signal_while_loading(monkeypatch, signal.SIGTERM)
  with pytest.raises(signals.Stopped, match="stopped by SIGTERM while the data loaded") as e:
    loop.run(tiny(ckpt, metrics=str(tmp_path / "m.jsonl")))
  assert (e.value.exit_code, e.value.step, e.value.removed, loading["finished"]) == (143, None, [], False)
  assert (sorted(os.listdir(ckpt)), open(ckpt / lock.LOCK_NAME).read()) == before
  assert all(stepdirs.problem(str(ckpt / s)) is None for s in ("10", "20"))
  assert (tmp_path / "m.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


def test_a_signal_before_the_data_loads_says_so_and_reads_none_of_it(tmp_path, monkeypatch):
  """A signal while the run sets up (here: as it reports its notices, before it opens its outputs' folders) stops it
  before the data loads, which then never starts: the stop says before, not "while the data loaded (the loading
  stopped there)", which it said of a loading that never began."""
  monkeypatch.setattr(loop.report, "notices", lambda cfg: signal.raise_signal(signal.SIGTERM))
  monkeypatch.setattr(data, "load", lambda *a, **k: pytest.fail("loaded the data after the signal"))
  with pytest.raises(signals.Stopped) as e:
    loop.run(tiny(tmp_path / "new" / "c", metrics=str(tmp_path / "m.jsonl")))
  assert str(e.value) == ("stopped by SIGTERM before the data loaded (none of it was read), before any step: nothing "
                          "was built or compiled, nothing to save"), e.value
  assert (e.value.exit_code, e.value.step) == (143, None)
  assert os.listdir(tmp_path) == []  # the folders and files it made, removed


def test_a_signal_while_the_model_is_built_stops_before_compiling_and_removes_the_runs_folder(tmp_path, monkeypatch,
                                                                                             capsys):
  """SIGINT after the data loaded, while the model is built: the run stops before the step compiles (the step is
  never called), says nothing was trained, and removes the run folder it made (it holds nothing)."""
  monkeypatch.chdir(tmp_path)
  real = loop.build
  def build(*args, **kwargs):
    signal.raise_signal(signal.SIGINT)
    model, state = real(*args, **kwargs)
    return dataclasses.replace(model, train_step=lambda *a: pytest.fail("compiled the step after the signal")), state
  monkeypatch.setattr(loop, "build", build)
  with pytest.raises(SystemExit) as e:
    cli.main([*TINY, "--steps", "2"])
  err = capsys.readouterr().err
  assert e.value.code == 130, err
  assert "stopped by SIGINT after step 0: nothing was trained, nothing to save\nremoved what this run had made " \
         f"and not used: {tmp_path / 'runs'}/train-" in err, err
  assert os.listdir(tmp_path) == []


def losses_or_none(path) -> dict[int, float]:
  return losses(path) if os.path.exists(path) else {}


# --- bad flags: exit 2 with one line, before the model is built or anything compiled


def _file(tmp_path):
  (tmp_path / "file").write_text("x")
  return str(tmp_path / "file")


def _read_only_dir(tmp_path):
  if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses even root
    return "/sys/attnlayers-ckpt"
  (tmp_path / "ro").mkdir(mode=0o555)
  return str(tmp_path / "ro")


BAD_FLAGS = {
    "window-0": (lambda d: ["--window", "0"], "argument --window: must be >= 1, got 0"),
    "window-negative": (lambda d: ["--window", "-3"], "argument --window: must be >= 1, got -3"),
    "pattern-without-window": (lambda d: ["--window-pattern", "local,global"], "give window (tokens per window) too"),
    "pattern-local-without-window": (lambda d: ["--window-pattern", "local"],  # the model refuses it (not its default)
                                     "window_pattern 'local' says which layers use the window; give window (tokens per "
                                     "window) too (window is --window, window_pattern is --window-pattern)"),
    "pattern-unknown-word": (lambda d: ["--window", "8", "--window-pattern", "local,dense"],
                             "window_pattern must list 'local' or 'global' per layer"),
    "pattern-no-local-layer": (lambda d: ["--window", "16", "--window-pattern", "global,global,local"],
                               "window_pattern 'global,global,local' makes no layer of the 2 (n_layer) local"),
    "pattern-past-last-layer": (lambda d: ["--window", "16", "--window-pattern", "local,global,global"],
                                "window_pattern 'local,global,global' has 3 entries for 2 layers (n_layer): entries "
                                "past the last layer would apply to none; give at most 2 (e.g. 'local,global'"),
    "seed-2-32": (lambda d: ["--seed", str(2**32)], "seed must be in [0, 2**32): jax.random.key keeps a seed's low "
                  "32 bits"),
    "batch-size-0": (lambda d: ["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    "batch-size-neg": (lambda d: ["--batch-size", "-4"], "argument --batch-size: must be >= 1, got -4"),
    "seq-len-0": (lambda d: ["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
    "seq-len-neg": (lambda d: ["--seq-len", "-1"], "argument --seq-len: must be >= 1, got -1"),
    "kv-heads-0": (lambda d: ["--kv-heads", "0"], "argument --kv-heads: must be >= 1, got 0"),
    "kv-heads-3": (lambda d: ["--kv-heads", "3"], "n_head (4) must be divisible by n_kv_head (3): n_kv_head one of "
                   "1, 2, 4 (1 = MQA, 4 = MHA) (n_head is --n-head, n_kv_head is --kv-heads)"),
    "n-head-3": (lambda d: ["--n-head", "3"], "d_model (128) must be divisible by n_head (3): n_head one of 1, 2, 4, "
                 "8, 16, 32, 64, 128, or another d_model (n_head is --n-head, d_model is --d-model)"),
    "n-head-0": (lambda d: ["--n-head", "0"], "argument --n-head: must be >= 1, got 0"),
    # GPTConfig's words name its fields: the flags that set them are named beside them
    "fp8-core-without-te-fp8": (lambda d: ["--attn", "xla", "--fp8-core", "bf16"],
                                "error: fp8_core='bf16' applies to backend 'te-fp8' only; got backend 'xla' "
                                "(fp8_core is --fp8-core, backend is --attn)"),
    "ckpt-every-0": (lambda d: ["--ckpt-every", "0"], "argument --ckpt-every: must be >= 1, got 0"),
    "log-every-0": (lambda d: ["--log-every", "0"], "argument --log-every: must be >= 1, got 0"),
    "steps-neg": (lambda d: ["--steps", "-5"], "argument --steps: must be >= 1, got -5"),
    "lr-neg": (lambda d: ["--lr", "-1"], "argument --lr: must be a finite number > 0, got -1"),
    "lr-nan": (lambda d: ["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    "warmup-neg": (lambda d: ["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    "profile-too-few-steps": (lambda d: ["--steps", "10", "--profile-dir", str(d / "p")],
                              "--profile-dir traces steps 11-15 of the run, but --steps is 10: give --steps 15 or "
                              "more, or leave out --profile-dir"),
    "ckpt-dir-is-a-file": (lambda d: ["--ckpt-dir", _file(d)], "not a folder (a file is in the way)"),
    "ckpt-dir-read-only": (lambda d: ["--ckpt-dir", _read_only_dir(d)], "cannot write there"),
    "metrics-is-a-folder": (lambda d: ["--metrics", str(d)], "is a folder; give a file path"),
    "profile-dir-is-a-file": (lambda d: ["--steps", "20", "--profile-dir", _file(d)], "is a file; give a folder"),
    "profile-dir-unwritable": (lambda d: ["--steps", "20", "--profile-dir", "/proc/attnlayers-trace"],
                               "--profile-dir /proc/attnlayers-trace: cannot write there"),
    "ckpt-dir-inside-data": (lambda d: ["--data", str(d), "--ckpt-dir", str(d / "ck")],
                             f"--ckpt-dir {{d}}/ck lies in what --data {{d}} reads"),
    "metrics-inside-data": (lambda d: ["--data", str(d), "--metrics", str(d / "sub" / "m.jsonl")],
                            f"--metrics {{d}}/sub/m.jsonl lies in what --data {{d}} reads"),
    "metrics-is-the-data-file": (lambda d: ["--data", _file(d), "--metrics", _file(d)],
                                 f"--metrics {{d}}/file lies in what --data {{d}}/file reads"),
    "metrics-matched-by-shards": (lambda d: ["--data", str(d / "*.bin"), "--metrics", str(d / "m.bin")],
                                  f"--metrics {{d}}/m.bin lies in what --data {{d}}/*.bin reads"),
    "profile-dir-inside-data": (lambda d: ["--steps", "20", "--data", str(d), "--profile-dir", str(d / "p")],
                                f"--profile-dir {{d}}/p lies in what --data {{d}} reads"),
    # a setting TrainConfig refuses and an output where --data reads: both, in one line
    "profile-too-few-steps-inside-data": (lambda d: ["--steps", "10", "--data", str(d), "--profile-dir",
                                                     str(d / "p")],
                                          "give --steps 15 or more, or leave out --profile-dir; --profile-dir {d}/p "
                                          "lies in what --data {d} reads"),
    "ckpt-every-with-no-ckpt": (lambda d: ["--no-ckpt", "--ckpt-every", "5"],
                                "--ckpt-every applies to checkpoints, and --no-ckpt keeps none: leave out "
                                "--ckpt-every, or --no-ckpt"),
    "allow-change-with-no-ckpt": (lambda d: ["--no-ckpt", "--ckpt-every", "5", "--allow-change", "steps"],
                                  "--ckpt-every and --allow-change apply to checkpoints, and --no-ckpt keeps none"),
    "allow-change-without-ckpt-dir": (lambda d: ["--allow-change", "steps"],
                                      "--allow-change applies to a resume from --ckpt-dir; without it the run starts "
                                      "in a new folder of its own (runs/train-YYYYmmdd-HHMMSS) with nothing to "
                                      "resume: give --ckpt-dir"),
    "shard-pattern-unquoted": (lambda d: ["--data", *(str(d / f"s_{i}.bin") for i in range(5))],
                               "--data {d}/s_0.bin is followed by 4 more .bin file(s) ({d}/s_1.bin {d}/s_2.bin "
                               "{d}/s_3.bin ...): the shell expanded an unquoted pattern into the files it matches, and "
                               "--data takes one. Quote the pattern so that it reaches python -m train whole: "
                               "--data '{d}/*.bin'"),
    "unrecognized-argument": (lambda d: ["--data", str(d / "a.bin"), str(d / "notes.txt")],  # not all .bin: argparse's
                              f"unrecognized arguments: {{d}}/notes.txt"),
    "shard-pattern-unquoted-equals": (lambda d: [f"--data={d}/s_0.bin", str(d / "s_1.bin")],
                                      "--data {d}/s_0.bin is followed by 1 more .bin file(s) ({d}/s_1.bin): the shell "
                                      "expanded an unquoted pattern"),
    # the shell's expansion of one pattern comes right after --data, names no pattern, and no option; else argparse's
    # message (these said the shell had expanded a pattern, and named one that the arguments did not come from)
    "shard-patterns-quoted": (lambda d: ["--data", str(d / "train" / "*.bin"), str(d / "val" / "*.bin")],
                              "error: unrecognized arguments: {d}/val/*.bin (see"),
    "bin-before-data": (lambda d: [str(d / "x.bin"), "--data", str(d / "a.bin")],
                        "error: unrecognized arguments: {d}/x.bin (see"),
    "option-ending-in-bin": (lambda d: ["--data", str(d / "a.bin"), "--out.bin"],
                             "error: unrecognized arguments: --out.bin (see"),
    "shards-of-two-folders-unquoted": (lambda d: ["--data", str(d / "a" / "s_0.bin"), str(d / "b" / "s_1.bin")],
                                       "the shell expanded an unquoted pattern into the files it matches, and --data "
                                       "takes one. Quote the pattern so that it reaches python -m train whole (the "
                                       "files are in several folders: quote the pattern you typed)"),
    "multihost-partial": (lambda d: ["--num-processes", "2"], "multi-host runs need all of --coordinator-address"),
    # jax.distributed.initialize took an address without a port and failed with an IndexError traceback
    "coordinator-without-port": (lambda d: ["--coordinator-address", "localhost", "--num-processes", "1",
                                            "--process-id", "0"],
                                 "argument --coordinator-address: expected host:port, e.g. 10.0.0.1:1234"),
    "coordinator-port-not-a-number": (lambda d: ["--coordinator-address", "host:http", "--num-processes", "1",
                                                 "--process-id", "0"], "expected host:port"),
    "multihost-process-id": (lambda d: ["--coordinator-address", "127.0.0.1:1", "--num-processes", "1",
                                        "--process-id", "3"], "--process-id 3 must be below --num-processes 1"),
}


if jax.default_backend() == "cpu":  # float16 matmuls exist on GPUs
  BAD_FLAGS["float16-on-cpu"] = (lambda d: ["--dtype", "float16"], "--dtype float16 needs a GPU")


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag_exits_2_before_building_anything(tmp_path, case, capsys, monkeypatch):
  def never(*args, **kwargs):
    raise AssertionError("got as far as loading data or building the model")
  monkeypatch.setattr(data, "load", never)
  monkeypatch.setattr(loop, "build", never)
  args, message = BAD_FLAGS[case]
  with pytest.raises(SystemExit) as e:
    cli.main([*TINY, *args(tmp_path)])
  err = capsys.readouterr().err
  message = message.replace("{d}", str(tmp_path))
  assert e.value.code == 2 and message in err, err
  assert len(err.strip().splitlines()) == 1, err


def test_arguments_left_over_get_argparse_own_message(tmp_path, monkeypatch, capsys):
  """Arguments that are not a shell's expansion of --data's pattern are refused in argparse's words, as argparse
  has them now (here, reworded through its translation hook), not a copy of them that could drift from it."""
  reworded = lambda text: text.replace("unrecognized arguments", "arguments nobody asked for")
  monkeypatch.setattr(argparse, "_", lambda text, gettext=argparse._: reworded(gettext(text)))
  with pytest.raises(SystemExit) as e:
    cli.parse(["--data", str(tmp_path / "a.bin"), str(tmp_path / "notes.txt")])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err == f"error: arguments nobody asked for: {tmp_path}/notes.txt (see python -m train " \
                                      "--help)\n", err


@pytest.mark.slow
@pytest.mark.parametrize("case", ["batch-size-0", "lr-nan", "metrics-is-a-folder"])
def test_bad_flag_exits_2_within_seconds(tmp_path, case):
  """The whole process, python's start and jax's import included."""
  args, message = BAD_FLAGS[case]
  t0 = time.perf_counter()
  rc, _, err = train_cli([*TINY, *args(tmp_path)])
  assert rc == 2 and message in err, err
  assert time.perf_counter() - t0 < 15


def test_run_outputs_where_the_data_is_read_are_refused_before_any_folder_is_made(tmp_path, monkeypatch, capsys):
  """A checkpoint folder inside --data (given, or the default runs/ under --data .) is refused before it is made:
  the run's own checkpoints would be read as training text on the next start, which could then never resume."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "a.txt").write_text("x = 1\n" * 300)
  monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("got as far as building the model"))
  for flags, message in [([], "the run folder runs/ (where a run without --ckpt-dir keeps its checkpoints) lies in "
                              "what --data . reads"),
                         (["--ckpt-dir", "ck"], "--ckpt-dir ck lies in what --data . reads")]:
    with pytest.raises(SystemExit) as e:
      cli.main([*TINY, "--steps", "2", "--data", ".", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "could not resume" in err, err
  assert sorted(os.listdir(tmp_path)) == ["a.txt"]  # neither runs/ nor ck/ made


def test_a_data_folder_holding_earlier_runs_is_refused_before_the_checkpoint_folder_is_touched(tmp_path):
  """--data DIR with an earlier run's folder inside (its lock file and a sealed step's manifest): its checkpoint
  files would be read as training text, so the run is refused, saying which folders and what would work."""
  corpus = tmp_path / "corpus"
  os.makedirs(corpus / "runs" / "old" / "10")
  for i in range(3):
    (corpus / f"{i}.txt").write_text("x = 1\n" * 300)
  (corpus / "runs" / "old" / lock.LOCK_NAME).write_text("")
  with pytest.raises(ValueError, match=re.escape(f"--data {str(corpus)!r} holds 1 python -m train run folder(s) "
                                                 f"({corpus / 'runs' / 'old'}: checkpoints and logs, not text)")):
    loop.run(tiny(tmp_path / "c", data=str(corpus)))
  assert not (tmp_path / "c").exists()
  os.remove(corpus / "runs" / "old" / lock.LOCK_NAME)  # a step folder alone (its manifest) says the same
  (corpus / "runs" / "old" / "10" / stepdirs.MANIFEST).write_text("{}")
  with pytest.raises(ValueError, match=re.escape(f"({corpus / 'runs' / 'old'}: checkpoints and logs")):
    data.load(str(corpus), 16)
  os.remove(corpus / "runs" / "old" / "10" / stepdirs.MANIFEST)
  assert data.load(str(corpus), 16).files == tuple(str(corpus / f"{i}.txt") for i in range(3))


def test_data_that_is_a_run_folder_or_a_checkpoint_step_says_so(tmp_path):
  """--data naming a run folder itself, or one of its steps: the message said the folder 'holds' a run folder (for a
  step, its parent, which it does not hold) and offered 'a subfolder of it that has none'."""
  run = tmp_path / "old"
  os.makedirs(run / "10")
  (run / lock.LOCK_NAME).write_text("")
  (run / "10" / stepdirs.MANIFEST).write_text("{}")
  (run / "10" / "params").write_text("x = 1\n" * 300)
  for spec in (run, run / "10"):
    with pytest.raises(ValueError, match=re.escape(f"--data {str(spec)!r} is python -m train's run folder {run} or a "
                                                   "checkpoint step in it (checkpoints and logs, not text)")):
      data.load(str(spec), 16)


# --- resuming with other settings


def test_other_data_under_the_same_path_is_refused_and_a_relative_path_is_the_same(tmp_path, monkeypatch):
  """A checkpoint records its data's resolved path and content: a file replaced by another, even of the same size,
  is noticed; the same file given relative to here instead of absolute is the same data."""
  text = tmp_path / "d.txt"
  text.write_bytes(bytes(range(32, 127)) * 100)
  loop.run(tiny(tmp_path / "c", data=str(text), steps=10))
  monkeypatch.chdir(tmp_path)
  assert loop.run(tiny(tmp_path / "c", data="d.txt", steps=20, allow_change=("steps",)))["steps"] == 20
  text.write_bytes(bytes(range(126, 31, -1)) * 100)  # the same size, other bytes
  with pytest.raises(checkpoint.ResumeMismatchError, match=rf"data: '{re.escape(str(text))}' held other data when "
                     r"the checkpoint was saved: \{'train': 8550, 'val': 950, 'sha256': '[0-9a-f]{64}'\} then.*"
                     r"accept with --allow-change data"):
    loop.run(tiny(tmp_path / "c", data="d.txt", steps=30, allow_change=("steps",)))
  assert loop.run(tiny(tmp_path / "c", data="d.txt", steps=30, allow_change=("steps", "data")))["steps"] == 30


def test_allow_change_data_accepts_other_data_and_says_so(tmp_path, capsys):
  """--allow-change data: a resume on another file (or on the same rewritten) is accepted, printed and recorded."""
  one, two = tmp_path / "one.txt", tmp_path / "two.txt"
  one.write_bytes(bytes(range(32, 127)) * 100)
  two.write_bytes(bytes(range(126, 31, -1)) * 120)
  common = [*TINY, "--steps", "10", "--ckpt-dir", str(tmp_path / "c"), "--metrics", str(tmp_path / "m.jsonl")]
  cli.main([*common, "--data", str(one)])
  with pytest.raises(SystemExit) as e:
    cli.main([*common, "--steps", "20", "--allow-change", "steps", "--data", str(two)])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "data: checkpoint" in err and "or accept it with --allow-change data" in err, err
  cli.main([*common, "--steps", "20", "--allow-change", "steps", "--allow-change", "data", "--data", str(two)])
  out = capsys.readouterr().out
  assert f"--allow-change data: {str(one)!r} in the checkpoint, {str(two)!r} from now on" in out, out
  assert out.index("resumed from") < out.index("--allow-change data:"), out  # said once the restore is done
  assert "--allow-change data: content {'train': 8550" in out, out
  resume = [json.loads(line) for line in open(tmp_path / "m.jsonl") if '"resume"' in line][-1]
  assert set(resume["changed"]) == {"steps", "data", "data_content"}, resume


def test_a_checkpoint_saved_before_data_content_was_kept_resumes_on_its_path_as_typed(tmp_path, monkeypatch):
  """Such a checkpoint recorded --data as typed: it resumes where that path resolves to this run's, never on
  the default data's name taken as a path."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "d.txt").write_text("x")
  now = {"data_content": {"train": 5, "val": 1, "sha256": "0" * 64}, "model": {}, "seed": 0, "pack": False, "run": {}}
  old = {"model": {}, "seed": 0, "pack": False, "run": {}}
  assert checkpoint.check_meta("c", 1, old | {"data": "d.txt"}, now | {"data": data.source("d.txt")}) == {}
  assert checkpoint.check_meta("c", 1, old | {"data": "python-stdlib"}, now | {"data": "python-stdlib"}) == {}
  with pytest.raises(checkpoint.ResumeMismatchError, match="data: checkpoint 'python-stdlib', now"):
    checkpoint.check_meta("c", 1, old | {"data": "python-stdlib"}, now | {"data": data.source("python-stdlib")})


def test_a_resume_on_other_data_names_the_path_and_not_a_content_change_it_never_had():
  """The checkpoint trained on a.txt; this run reads b.txt. One difference, the path: b.txt did not hold other data
  "when the checkpoint was saved" (it was never read), so the content line, which says that, is left out."""
  run = {"model": {}, "seed": 0, "pack": False, "run": {}}
  saved = run | {"data": "/d/a.txt", "data_content": {"train": 5, "val": 1, "sha256": "a" * 64}}
  now = run | {"data": "/d/b.txt", "data_content": {"train": 7, "val": 1, "sha256": "b" * 64}}
  with pytest.raises(checkpoint.ResumeMismatchError) as e:
    checkpoint.check_meta("c", 1, saved, now)
  assert "data: checkpoint '/d/a.txt', now '/d/b.txt'" in str(e.value) and "held other data" not in str(e.value)
  assert set(checkpoint.check_meta("c", 1, saved, now, allow_change=("data",))) == {"data", "data_content"}


@pytest.mark.parametrize("saved_path, now_path, path_line", [
    ("/d/a.txt", "/d/a.txt", False),  # the same path: its content changed
    ("d.txt", "{tmp}/d.txt", False),  # typed relative to here by an older run: the same path
    ("/d/a.txt", "/d/b.txt", True),  # another path: that is the difference, not the content
    (None, "/d/b.txt", True),  # a checkpoint that recorded no data
])
def test_the_content_line_follows_whether_the_data_path_changed(saved_path, now_path, path_line, tmp_path,
                                                                 monkeypatch):
  """check_meta says the data's content changed only where the path did not: decided by the recorded paths (and
  every other difference, the seed's here, leaves it as it is)."""
  monkeypatch.chdir(tmp_path)
  run = {"model": {}, "pack": False, "run": {}}
  saved = run | {"seed": 0, "data": saved_path, "data_content": {"train": 5, "val": 1, "sha256": "a" * 64}}
  now = run | {"seed": 1, "data": now_path.format(tmp=os.path.realpath(tmp_path)),
               "data_content": {"train": 7, "val": 1, "sha256": "b" * 64}}
  with pytest.raises(checkpoint.ResumeMismatchError) as e:
    checkpoint.check_meta("c", 1, saved, now)
  lines = str(e.value).splitlines()
  assert "  seed: checkpoint 0, now 1 (python -m train sets it with --seed)" in lines, lines
  assert any(line.startswith("  data: checkpoint ") for line in lines) == path_line, lines
  assert any("held other data when the checkpoint was saved" in line for line in lines) != path_line, lines


@pytest.mark.parametrize("flags, difference", [
    (["--lr", "1e-3"], "run.lr: checkpoint 0.003, now 0.001 (accept with --allow-change lr)"),
    (["--batch-size", "16"], "run.batch_size: checkpoint 8, now 16 (accept with --allow-change batch_size)"),
    (["--steps", "30"], "run.steps: checkpoint 20, now 30 (accept with --allow-change steps)"),
    (["--dtype", "bfloat16"], "run.dtype: checkpoint 'float32', now 'bfloat16' (accept with --allow-change dtype)"),
    (["--warmup", "5"], "run.warmup: checkpoint 30, now 5 (accept with --allow-change warmup)"),
], ids=["lr", "batch-size", "steps", "dtype", "warmup"])
def test_resume_with_changed_setting_is_refused(ckpt, flags, difference, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main([*TINY, "--steps", "20", "--ckpt-every", "10", "--ckpt-dir", str(ckpt), *flags])
  err = capsys.readouterr().err
  assert e.value.code == 2 and f"cannot resume from {ckpt} (step 20)" in err and difference in err, err


def test_steps_extension_with_allow_change_is_recorded(ckpt, tmp_path, capsys):
  metrics = tmp_path / "m.jsonl"
  cli.main([*TINY, "--steps", "22", "--ckpt-every", "10", "--ckpt-dir", str(ckpt), "--metrics", str(metrics),
            "--allow-change", "steps"])
  assert "--allow-change steps: 20 in the checkpoint, 22 from now on" in capsys.readouterr().out
  rows = [json.loads(line) for line in open(metrics)]
  assert rows[0] == {"event": "resume", "step": 20, "ckpt_dir": str(ckpt), "changed": {"steps": {"from": 20, "to": 22}}}
  assert rows[1]["event"] == "start" and rows[1]["from_step"] == 20 and rows[-1]["event"] == "summary"
  assert [r["step"] for r in rows[2:-1]] == [21, 22]


def test_a_checkpoint_from_before_the_lr_schedule_was_recorded_resumes_only_where_allowed(tmp_path):
  """A run saved before the warm-up started at lr / (warmup + 1) warmed up from 0: resuming it on the new rule
  would not continue it, so it needs --allow-change lr_schedule (and the CLI takes that flag)."""
  now = {"model": {"n_layer": 2}, "seed": 0, "data": "python-stdlib", "pack": False,
         "run": {"lr": 1.0, "lr_schedule": optim.LR_SCHEDULE}}
  old = now | {"run": {"lr": 1.0}}  # no lr_schedule key
  with pytest.raises(checkpoint.ResumeMismatchError) as e:
    checkpoint.check_meta(str(tmp_path), 5, old, now)
  was = "warm-up lr * s / warmup, cosine to lr / 10 after the last step"
  assert (f"run.lr_schedule: checkpoint {was!r}, now {optim.LR_SCHEDULE!r} (accept with --allow-change "
          "lr_schedule)") in str(e.value)
  assert checkpoint.check_meta(str(tmp_path), 5, old, now, ("lr_schedule",)) == {
      "lr_schedule": {"from": was, "to": optim.LR_SCHEDULE}}
  assert checkpoint.check_meta(str(tmp_path), 5, now, now) == {}
  assert cli.parser().parse_args(["--allow-change", "lr-schedule"]).allow_change == ["lr_schedule"]


def test_a_checkpoint_from_before_the_decay_rule_was_recorded_resumes_only_where_allowed(tmp_path):
  """A run saved before weight decay skipped the (heads, head_dim) q/k/v biases decayed them: resuming it on the
  new rule needs --allow-change decay_rule."""
  now = {"model": {"n_layer": 2}, "seed": 0, "data": "python-stdlib", "pack": False,
         "run": {"lr": 1.0, "decay_rule": optim.DECAY_RULE}}
  old = now | {"run": {"lr": 1.0}}  # no decay_rule key
  with pytest.raises(checkpoint.ResumeMismatchError, match="run.decay_rule: checkpoint 'every parameter of 2 or more "
                     r"dimensions \(the q/k/v biases too\)', .* \(accept with --allow-change decay_rule\)"):
    checkpoint.check_meta(str(tmp_path), 5, old, now)
  assert list(checkpoint.check_meta(str(tmp_path), 5, old, now, ("decay_rule",))) == ["decay_rule"]
  assert cli.parser().parse_args(["--allow-change", "decay-rule"]).allow_change == ["decay_rule"]


@pytest.mark.parametrize("allow", [["--allow-change", "steps"], []], ids=["allowed", "not-allowed"])
def test_steps_below_the_checkpoint_are_refused_and_nothing_is_written(ckpt, tmp_path, capsys, allow):
  """With or without --allow-change steps the refusal says there is nothing to train, and gives the whole of what
  trains on: --steps above the step, with --allow-change steps (the checkpoint's run had 20)."""
  before = sorted(os.listdir(ckpt))
  with pytest.raises(SystemExit) as e:
    cli.main([*TINY, "--steps", "15", "--ckpt-every", "10", "--ckpt-dir", str(ckpt), *allow,
              "--metrics", str(tmp_path / "m.jsonl")])
  err = capsys.readouterr().err
  assert e.value.code == 2 and f"{ckpt} holds step 20, past --steps 15: there is nothing to train" in err, err
  assert "Give --steps above 20 with --allow-change steps (its run had --steps 20) to train on from it" in err, err
  assert sorted(os.listdir(ckpt)) == before and not (tmp_path / "m.jsonl").exists()  # it made the file: removed
  cli.main([*TINY, "--steps", "21", "--ckpt-every", "10", "--ckpt-dir", str(ckpt), "--allow-change", "steps"])
  assert "resumed from" in capsys.readouterr().out  # the hint, followed, trains


def test_steps_below_a_checkpoint_its_run_had_not_finished_name_its_own_steps(ckpt, capsys):
  """Step 10 of a 20-step run: --steps 20 resumes it unchanged; other --steps take --allow-change steps."""
  shutil.rmtree(ckpt / "20")
  with pytest.raises(SystemExit) as e:
    cli.main([*TINY, "--steps", "5", "--ckpt-every", "10", "--ckpt-dir", str(ckpt)])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "holds step 10, past --steps 5: there is nothing to train. Give --steps 20 (its " \
      "run's own) or other --steps above 10 with --allow-change steps to train on from it" in err, err


def test_checkpoint_with_other_array_shapes_is_one_line(tmp_path):
  ckpts = checkpoint.Checkpoints(str(tmp_path / "c"))
  try:
    ckpts.save(1, {"params": {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}, "fp8": {}}, {"seed": 0})
    with pytest.raises(checkpoint.ResumeMismatchError) as e:
      ckpts.restore(1, {"params": {"w": jnp.ones((3, 5)), "b": jnp.zeros(4)}, "fp8": {}})
  finally:
    ckpts.close()
  assert str(e.value) == (f"cannot resume from {tmp_path / 'c'} (step 1): its arrays do not fit this model: "
                          "params.w: checkpoint (3, 4) float32, now (3, 5) float32")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU cudnn and the Pallas kernels run")
@pytest.mark.parametrize("flags, hint", [(["--attn", "cudnn"], "here: --attn NAME picks the backend"),
                                         (["--kernels", "pallas"], "here: --kernels xla, interpret or auto")])
def test_refusals_name_the_flags_that_do_what_the_library_message_says(tmp_path, flags, hint, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main([*TINY, "--steps", "1", "--ckpt-dir", str(tmp_path / "c"), *flags])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.strip().splitlines()[-1].startswith(hint), err


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU cudnn runs")
@pytest.mark.parametrize("dtype, says_dtype", [("float32", True), ("bfloat16", False)])
def test_the_backend_hint_names_dtype_only_where_it_was_not_given_as_half(tmp_path, capsys, dtype, says_dtype):
  with pytest.raises(SystemExit):
    cli.main([*TINY, "--steps", "1", "--ckpt-dir", str(tmp_path / "c"), "--attn", "cudnn", "--dtype", dtype])
  hint = capsys.readouterr().err.strip().splitlines()[-1]
  assert ("--dtype bfloat16 (or float16 on a GPU)" in hint) == says_dtype, hint


def test_what_data_reads_is_what_load_reads(tmp_path, monkeypatch):
  """train.overlap.reads follows load(): a link to a folder inside --data is read (glob follows it), a hidden name is
  not (glob skips it), and a .bin pattern's '*' stays within one folder."""
  monkeypatch.chdir(tmp_path)
  for d in ("corpus/sub", "outside", "shards/sub"):
    os.makedirs(d)
  os.symlink("../outside", "corpus/link")
  assert overlap.reads("corpus", "outside/ck") and overlap.reads("corpus", "corpus/link/ck")
  assert overlap.reads("corpus", "corpus/sub/m.jsonl") and not overlap.reads("corpus", "corpus/.ckpt")
  assert not overlap.reads("corpus", "elsewhere") and overlap.reads("corpus/a.txt", "corpus/a.txt")
  assert overlap.reads("shards/*.bin", "shards/m.bin") and not overlap.reads("shards/*.bin", "shards/sub/m.bin")
  assert not overlap.reads("shards/*.bin", "shards/.m.bin")
  os.symlink("..", "corpus/up")  # a loop of links ends
  assert overlap.reads("corpus", "shards-x")  # the link leads above: glob reads all there, and so it ends


def test_the_run_outputs_are_checked_with_one_walk_of_the_data_folder_the_walk_load_makes(tmp_path, monkeypatch):
  """loop.run checks all of the run's outputs against what --data reads with one walk of the folder (it walked it
  again for each), and that walk is load's: a link inside --data to a hidden folder is read through the link, so an
  output in that folder is refused (it was let through, then read as training text on the next start). Making the
  TrainConfig, or a copy of it, walks nothing (each walked the folder, where not handed the walk again)."""
  monkeypatch.chdir(tmp_path)
  os.makedirs("corpus/.hidden")
  os.symlink(".hidden", "corpus/link")
  (tmp_path / "corpus" / ".hidden" / "a.txt").write_text("x = 1\n" * 300)
  assert data.load("corpus", 16).files == ("corpus/link/a.txt",)
  assert overlap.reads("corpus", "corpus/.hidden/ck") and not overlap.reads("corpus", "corpus/.other/ck")
  walks, real_walk = [], os.walk
  monkeypatch.setattr(os, "walk", lambda top, **kw: walks.append(top) or real_walk(top, **kw))
  cfg = config.TrainConfig(model=models.preset("tiny"), steps=20, data="corpus", ckpt_dir="corpus/ck",
                           metrics="corpus/sub/m.jsonl", profile_dir="corpus/.hidden/p")
  cfg = dataclasses.replace(cfg, steps=30)
  assert walks == [], walks
  with pytest.raises(ValueError) as e:
    loop.run(cfg)
  assert walks == ["corpus"], walks
  assert not os.path.exists("corpus/ck") and not os.path.exists("corpus/sub")  # refused before anything is made
  assert all(f"{output} lies in what --data corpus reads" in str(e.value)
             for output in ("--ckpt-dir corpus/ck", "--metrics corpus/sub/m.jsonl", "--profile-dir corpus/.hidden/p")), e.value


def test_a_trainer_start_walks_the_data_folder_once(tmp_path, monkeypatch):
  """python -m train --data DIR walks DIR once from its flags to the model's build: the check of its outputs (the
  CLI's on its flags, loop.run's on its config), the check of runs/ and load read that walk (they walked it five
  times for a fresh, packed run with --metrics: TrainConfig checked the outputs again on each of its copies)."""
  monkeypatch.chdir(tmp_path)
  os.makedirs("corpus/sub")
  for name in ("a.txt", "sub/b.txt"):
    (tmp_path / "corpus" / name).write_text("x = 1\n" * 300)
  walks, real_walk = [], os.walk
  monkeypatch.setattr(os, "walk", lambda top, **kw: walks.append(top) or real_walk(top, **kw))
  class Built(Exception):
    """The start-up is over: the data loaded, the packed model's cfg made."""
  def build(cfg, *_):
    raise Built(cfg)
  monkeypatch.setattr(loop, "build", build)
  with pytest.raises(Built) as e:
    cli.main([*TINY, "--steps", "2", "--data", "corpus", "--pack", "--metrics", "m.jsonl"])
  assert e.value.args[0].model.max_segments is not None  # loop.run's packed cfg, made after the data loaded
  assert walks.count("corpus") == 1, walks
  with pytest.raises(ValueError, match=re.escape("a Walk of --data 'other' was given for --data 'corpus'")):
    data.load("corpus", 16, walk=data.Walk("other"))  # its folders are not corpus's


def test_a_window_pattern_longer_than_the_model_resumes_as_the_layers_used_it(tmp_path):
  """A checkpoint an earlier trainer wrote with --window 16 --window-pattern local,global,global for 2 layers
  (GPTConfig now refuses the flags): its layers used 'local,global', so a resume with that pattern continues it,
  and one with another pattern is refused."""
  now = {"model": models.preset("tiny", window=16, window_pattern="local,global").architecture(), "seed": 0,
         "pack": False}
  old = now | {"model": now["model"] | {"window_pattern": "local,global,global"}}
  assert checkpoint.check_meta(str(tmp_path), 5, old, now) == {}
  other = now | {"model": models.preset("tiny", window=16, window_pattern="local").architecture()}
  with pytest.raises(checkpoint.ResumeMismatchError,
                     match="model.window_pattern: checkpoint 'local,global', now 'local'"):
    checkpoint.check_meta(str(tmp_path), 5, old, other)


def test_a_window_that_applied_to_no_layer_resumes_as_the_model_without_one(tmp_path):
  """A checkpoint an earlier trainer wrote with --window 16 --window-pattern global,global,local for 2 layers
  (GPTConfig now refuses the flags): its model had no window, so a resume without --window continues it."""
  now = {"model": models.preset("tiny").architecture(), "seed": 0, "pack": False}
  old = now | {"model": now["model"] | {"window": 16, "window_pattern": "global,global,local"}}
  assert checkpoint.check_meta(str(tmp_path), 5, old, now) == {}
  windowed = now | {"model": models.preset("tiny", window=16).architecture()}
  with pytest.raises(checkpoint.ResumeMismatchError, match="model.window: checkpoint None, now 16"):
    checkpoint.check_meta(str(tmp_path), 5, old, windowed)
