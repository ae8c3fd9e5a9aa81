"""Rotation (deleting all but the newest checkpoints) stopped part-way, on CPU.

A step is renamed to `<step>.removing`, named in attnlayers.removing first, before it is deleted: a trainer killed
while deleting leaves that folder, which the next start deletes and says so; never a step folder that has lost its
manifest, which no later start could tell from a user's folder. Folders of that shape the journal does not name
are left alone.
"""

import os
import signal
import subprocess
import sys

import jax.numpy as jnp
import pytest

from train import checkpoint, cli, stepdirs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = {"params": {"w": jnp.zeros(2)}}


def saved(directory, steps, keep=2) -> checkpoint.Checkpoints:
  ckpts = checkpoint.Checkpoints(str(directory), keep=keep)
  for step in steps:
    ckpts.save(step, STATE, {})
  return ckpts


def test_a_rotation_stopped_while_deleting_is_finished_on_the_next_start(tmp_path, monkeypatch, capsys):
  """Stopped after the step's manifest was deleted and before the rest: the next start deletes what is left,
  says so, and the newest step is the one it resumes from."""
  ckpts = saved(tmp_path / "c", [1, 2])
  real = stepdirs.shutil.rmtree
  def stopped(path, *args, **kwargs):  # as a SIGKILL part-way through the deletion
    if not path.startswith(str(tmp_path)):
      return real(path, *args, **kwargs)
    os.remove(os.path.join(path, stepdirs.MANIFEST))
    raise KeyboardInterrupt
  monkeypatch.setattr(stepdirs.shutil, "rmtree", stopped)
  with pytest.raises(KeyboardInterrupt):
    ckpts.save(3, STATE, {})  # sealed, then rotation deletes step 1
  monkeypatch.undo()
  ckpts.close()
  capsys.readouterr()
  again = checkpoint.Checkpoints(str(tmp_path / "c"), keep=2)
  err = capsys.readouterr().err
  assert (f"removed {tmp_path / 'c' / '1.removing'}: an old step this program was deleting (rotation keeps the "
          "newest 2) when it was stopped") in err, err
  assert "has no attnlayers.json" not in err, err
  assert sorted(os.listdir(tmp_path / "c")) == ["2", "3", "attnlayers.lock"]
  assert again.newest_intact() == 3
  again.close()


# The trainer, killed by SIGKILL while rotation deletes step 2 (the run saves 2, 4, 6, 8 and keeps 3): the
# deletion removes the step's manifest first, then the process dies.
KILLED_IN_ROTATION = ("import os, shutil, signal, sys\nfrom train import cli, stepdirs\nreal = shutil.rmtree\n"
                      "def rmtree(path, *a, **k):\n  if os.path.basename(path) in ('2', '2.removing'):\n"
                      "    os.remove(os.path.join(path, stepdirs.MANIFEST))\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n  real(path, *a, **k)\n"
                      "stepdirs.shutil.rmtree = rmtree\ncli.main(sys.argv[1:])")
TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--no-progress", "--sample-tokens", "0",
        "--eval-every", "0", "--log-every", "1", "--ckpt-every", "2"]


@pytest.mark.slow
def test_a_trainer_killed_while_deleting_an_old_step_resumes_from_the_newest(tmp_path, capsys):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  run = [*TINY, "--ckpt-dir", str(tmp_path / "c")]
  proc = subprocess.run([sys.executable, "-c", KILLED_IN_ROTATION, *run, "--steps", "8"], cwd=ROOT, env=env,
                        text=True, capture_output=True, timeout=600)
  assert proc.returncode == -signal.SIGKILL, proc.stderr
  cli.main([*run, "--steps", "10", "--allow-change", "steps"])
  out, err = capsys.readouterr()
  assert f"removed {tmp_path / 'c' / '2.removing'}: an old step this program was deleting" in err, err
  assert "has no attnlayers.json" not in err, err
  assert f"resumed from {tmp_path / 'c'} at step 8" in out, out
  assert sorted(os.listdir(tmp_path / "c")) == ["10", "6", "8", "attnlayers.lock"]


def test_only_the_deletion_the_journal_names_is_finished(tmp_path, capsys):
  """Folders named as rotation names them are removed only where attnlayers.removing names one, and its step
  folder is gone (renamed to it): a user's `10.removing` beside an intact step 10 that a rotation stopped before
  renaming stays, as do ones the journal does not name."""
  saved(tmp_path / "c", [10], keep=3).close()
  for name in ("10.removing", "5.removing", "7.removing-2"):
    (tmp_path / "c" / name).mkdir()
    (tmp_path / "c" / name / "notes.txt").write_text("mine")
  (tmp_path / "c" / stepdirs.REMOVAL_JOURNAL).write_text("10.removing\n")
  capsys.readouterr()
  ckpts = checkpoint.Checkpoints(str(tmp_path / "c"), keep=3)
  err = capsys.readouterr().err
  assert sorted(os.listdir(tmp_path / "c")) == ["10", "10.removing", "5.removing", "7.removing-2", "attnlayers.lock"]
  assert all((tmp_path / "c" / n / "notes.txt").read_text() == "mine" for n in ("10.removing", "5.removing"))
  for name in ("10.removing", "5.removing", "7.removing-2"):
    assert f"{tmp_path / 'c' / name} is not a deletion attnlayers.removing names: it is left alone" in err, err
  assert ckpts.newest_intact() == 10
  ckpts.close()


def test_rotation_leaves_a_folder_that_has_its_name_alone(tmp_path):
  (tmp_path / "c").mkdir()
  (tmp_path / "c" / "1.removing").mkdir()
  (tmp_path / "c" / "1.removing" / "notes.txt").write_text("mine")
  saved(tmp_path / "c", [1, 2, 3]).close()  # deletes step 1 through 1.removing-2
  assert sorted(os.listdir(tmp_path / "c")) == ["1.removing", "2", "3", "attnlayers.lock"]
  assert (tmp_path / "c" / "1.removing" / "notes.txt").read_text() == "mine"


def test_a_step_an_earlier_version_was_stopped_deleting_is_named_as_one(tmp_path, capsys):
  """An attnlayers from before the journal deleted steps in place: what it left has orbax's files but no manifest.
  It is still never deleted (it may be a user's), but the message says what it likely is."""
  (tmp_path / "c" / "47" / "state").mkdir(parents=True)
  (tmp_path / "c" / "9").mkdir()
  (tmp_path / "c" / "9" / "notes.txt").write_text("mine")
  checkpoint.Checkpoints(str(tmp_path / "c")).close()
  lines = capsys.readouterr().err.splitlines()
  says = {n: next(l for l in lines if l.startswith(str(tmp_path / "c" / n) + " ")) for n in ("47", "9")}
  assert "it holds what orbax writes: it may be an old step that an older attnlayers, one without attnlayers.removing" in says["47"], lines
  assert "orbax" not in says["9"], lines
  assert sorted(os.listdir(tmp_path / "c")) == ["47", "9", "attnlayers.lock"]
