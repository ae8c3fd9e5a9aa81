"""A run refused before it trains leaves the disk as it found it (on CPU).

It removes what it made and left empty: the metrics file, the lock file, runs/ and the folders on the way
to --ckpt-dir or --profile-dir. Nothing else: a file or folder that was there before stays as it was,
byte for byte.
"""

import os

import pytest

from train import checkpoint, cli, lock, rundirs, undo

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--no-progress", "--sample-tokens", "0",
        "--eval-every", "0", "--log-every", "1"]
REFUSAL = "more than the model's vocab_size 10"  # --vocab-size 10: refused once the data is read, after the outputs


@pytest.fixture
def refused(tmp_path, capsys):
  """Runs python -m train with `args` on a small text and --vocab-size 10, which it refuses (exit 2)."""
  (tmp_path / "d.txt").write_bytes(bytes(range(32, 127)) * 100)
  def run(*args):
    with pytest.raises(SystemExit) as e:
      cli.main([*TINY, "--data", str(tmp_path / "d.txt"), "--vocab-size", "10", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and REFUSAL in err, err
  return run


@pytest.mark.parametrize("before", [None, b"", b'{"step": 1}\n'], ids=["new", "empty", "with-records"])
def test_a_refused_run_removes_only_a_metrics_file_it_created(tmp_path, refused, before):
  path = tmp_path / "m.jsonl"
  if before is not None:
    path.write_bytes(before)
  refused("--no-ckpt", "--metrics", str(path))
  assert path.read_bytes() == before if before is not None else not path.exists()


def test_a_refused_run_removes_the_lock_file_it_made_in_an_existing_folder(tmp_path, refused):
  (tmp_path / "c").mkdir()  # empty: a folder holding other files is refused before the lock (test_train_paths)
  refused("--ckpt-dir", str(tmp_path / "c"))
  assert os.listdir(tmp_path / "c") == []
  (tmp_path / "held").mkdir()
  (tmp_path / "held" / "attnlayers.lock").write_text("")  # an earlier run's: not this run's to remove
  refused("--ckpt-dir", str(tmp_path / "held"))
  assert os.listdir(tmp_path / "held") == ["attnlayers.lock"]


def test_a_refused_fresh_run_removes_the_runs_folder_it_made(tmp_path, refused, monkeypatch):
  monkeypatch.chdir(tmp_path)
  refused()
  assert not (tmp_path / rundirs.RUNS).exists()
  (tmp_path / rundirs.RUNS / "train-earlier").mkdir(parents=True)  # one that was there stays, as it was
  refused()
  assert os.listdir(tmp_path / rundirs.RUNS) == ["train-earlier"]


def test_a_refused_run_removes_the_folders_it_made_on_the_way_to_its_outputs(tmp_path, refused):
  (tmp_path / "kept").mkdir()
  refused("--steps", "20", "--ckpt-dir", str(tmp_path / "a" / "b" / "c"), "--profile-dir",
          str(tmp_path / "kept" / "p" / "q"))
  assert sorted(os.listdir(tmp_path)) == ["d.txt", "kept"] and os.listdir(tmp_path / "kept") == []


def test_a_run_refused_at_restore_writes_nothing_to_the_metrics_file(tmp_path, monkeypatch, capsys):
  """The resume and start records are written once the checkpoint is restored: a resume refused there (here
  restore raises as it does for arrays of other shapes) leaves an existing metrics file as it was."""
  common = [*TINY, "--ckpt-dir", str(tmp_path / "c"), "--metrics", str(tmp_path / "m.jsonl")]
  cli.main([*common, "--steps", "2"])
  before = (tmp_path / "m.jsonl").read_bytes()
  def refuse(self, step, like):
    raise checkpoint.ResumeMismatchError(f"cannot resume from {self.directory} (step {step}): its arrays differ")
  monkeypatch.setattr(checkpoint.Checkpoints, "restore", refuse)
  with pytest.raises(SystemExit) as e:
    cli.main([*common, "--steps", "4", "--allow-change", "steps"])
  assert e.value.code == 2 and "its arrays differ" in capsys.readouterr().err
  assert (tmp_path / "m.jsonl").read_bytes() == before


def test_a_trainer_that_opened_a_lock_file_removed_since_locks_the_one_there_now(tmp_path, monkeypatch):
  """A refused run removes the lock file it made while it still holds the lock: a trainer that opened that file
  just before gets the flock of a file no longer there once it is released, and must lock the path's file anew,
  or a third trainer would lock a new file beside it and both would run."""
  first = lock.DirLock(str(tmp_path))
  first.acquire()
  real, opened = lock._open_or_create, []
  def racing(path):
    if not opened:  # opens the file `first` holds; then `first` is refused: it removes the file and lets go
      opened.append(real(path))
      first.remove_made()
      first.release()
      return opened[0]
    return real(path)
  monkeypatch.setattr(lock, "_open_or_create", racing)
  second = lock.DirLock(str(tmp_path))
  second.acquire()
  assert undo.is_open_at(second.fd, second.path) and second.created
  with pytest.raises(lock.LockedError, match="in use by another trainer"):
    lock.DirLock(str(tmp_path)).acquire()
  second.release()
