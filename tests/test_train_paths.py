"""python -m train writes only where a run of its own lives, and an empty path never turns an output off (on CPU).

Each refusal comes before any work: exit code 2, one line naming the flag, and nothing on disk changed.
"""

import os

import pytest

from train import checks, cli, rundirs, stepdirs

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--steps", "1", "--no-progress",
        "--sample-tokens", "0", "--eval-every", "0"]


@pytest.fixture
def refused(tmp_path, capsys, monkeypatch):
  """Runs python -m train with `args` (in tmp_path), expects exit code 2 and returns its stderr."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / "d.txt").write_text("hello world\n" * 300)
  def run(*args):
    with pytest.raises(SystemExit) as e:
      cli.main([*TINY, "--data", str(tmp_path / "d.txt"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert not (tmp_path / rundirs.RUNS).exists()  # refused before the run's folder was made
    return err
  return run


def a_run(folder):
  """A checkpoint folder as python -m train leaves it: its lock file and a sealed step 3 (a manifest)."""
  (folder / "3").mkdir(parents=True)
  (folder / "3" / stepdirs.MANIFEST).write_text("{}")
  (folder / "attnlayers.lock").write_text("")
  return folder


@pytest.mark.parametrize("flag", ["--ckpt-dir", "--metrics", "--profile-dir", "--data", "--coordinator-address"])
def test_an_empty_path_is_refused_naming_its_flag(refused, flag):
  err = refused(flag, "")
  assert f"argument {flag}: an empty path" in err, err
  if flag == "--ckpt-dir":
    assert "--no-ckpt trains without checkpoints" in err, err


@pytest.mark.parametrize("flag", ["--ckpt-dir", "--metrics", "--data"])
def test_a_path_of_spaces_only_is_refused_naming_its_flag(refused, flag):
  """' ' (a variable quoted with a space around it) made a run folder named ' ', shown as "model saved in  "."""
  err = refused(flag, " ")
  assert f"argument {flag}: a path of spaces only (' ')" in err, err


def listing(folder):
  return sorted(os.path.relpath(os.path.join(top, n), folder) for top, dirs, files in os.walk(folder)
                for n in dirs + files)


def test_a_step_folder_of_another_run_is_refused_as_ckpt_dir(tmp_path, refused):
  run = a_run(tmp_path / "run")
  before = listing(run)
  err = refused("--ckpt-dir", str(run / "3"))
  assert (f"--ckpt-dir {run / '3'} is the step folder {os.path.realpath(run / '3')} of the checkpointed run in "
          f"{os.path.realpath(run)}" in err and f"--ckpt-dir {os.path.realpath(run)} resumes that run" in err), err
  err = refused("--ckpt-dir", str(run / "3" / "inner"))
  assert f"--ckpt-dir {run / '3' / 'inner'} lies in the step folder" in err, err
  assert listing(run) == before


def test_a_folder_of_other_files_is_refused_as_ckpt_dir(tmp_path, refused):
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("mine")
  err = refused("--ckpt-dir", str(tmp_path / "mine"))
  assert (f"--ckpt-dir {tmp_path / 'mine'} holds files that are not a checkpointed run of python -m train "
          "(notes.txt)") in err, err
  assert listing(tmp_path / "mine") == ["notes.txt"]  # no lock file made


@pytest.mark.parametrize("flag,name", [("--metrics", "m.jsonl"), ("--profile-dir", "trace")])
def test_an_output_inside_a_step_folder_is_refused(tmp_path, refused, flag, name):
  run = a_run(tmp_path / "run")
  before = listing(run)
  err = refused("--no-ckpt", flag, str(run / "3" / name))
  assert f"{flag} {run / '3' / name} lies in the step folder {os.path.realpath(run / '3')}" in err, err
  assert listing(run) == before


@pytest.mark.parametrize("folder", ["new", "empty", "run", "run-with-notes"])
def test_a_new_or_empty_folder_or_one_holding_a_run_is_taken_as_ckpt_dir(tmp_path, folder):
  path = tmp_path / folder
  if folder == "empty":
    path.mkdir()
  if folder.startswith("run"):
    a_run(path)
  if folder == "run-with-notes":  # a person's notes beside a run's checkpoints do not make it another's folder
    (path / "notes.txt").write_text("mine")
  s = cli.Start(cli.parse(["--ckpt-dir", str(path), "--metrics", str(path / "m.jsonl")]))
  assert checks._outputs_in_another_run(s) is None


@pytest.mark.parametrize("content", [b"my notes\n", b"\x7fELF\x02\x01binary", b"[1, 2]\n"], ids=["notes", "binary", "list"])
def test_a_metrics_file_of_other_text_is_refused_and_left_as_it_was(tmp_path, refused, content):
  """Records were appended to any file --metrics named: a user's notes or a binary gained JSON lines."""
  (tmp_path / "notes.md").write_bytes(content)
  err = refused("--no-ckpt", "--metrics", str(tmp_path / "notes.md"))
  assert f"--metrics {tmp_path / 'notes.md'}: holds other text (its first line is not a JSON record)" in err, err
  assert (tmp_path / "notes.md").read_bytes() == content


def test_a_metrics_file_of_records_or_empty_is_appended_to(tmp_path):
  from train import metrics
  for content in (b"", b'{"step": 1}\n'):
    (tmp_path / "m.jsonl").write_bytes(content)
    out = metrics.MetricsFile(str(tmp_path / "m.jsonl"))
    out.write({"step": 2})
    out.close()
    assert (tmp_path / "m.jsonl").read_bytes() == content + b'{"step": 2}\n'


@pytest.mark.parametrize("where", ["new", "run"])
def test_metrics_on_the_lock_file_of_the_run_is_refused(tmp_path, refused, where):
  """--metrics CKPT/attnlayers.lock: the run appended its records to its lock file, which is emptied when the lock
  is released, and the records were gone."""
  ckpt = tmp_path / "c" if where == "new" else a_run(tmp_path / "c")
  err = refused("--ckpt-dir", str(ckpt), "--metrics", str(ckpt / "attnlayers.lock"))
  assert f"--metrics {ckpt / 'attnlayers.lock'} names a file python -m train keeps in a run's checkpoint folder" in err
  assert where == "run" or not ckpt.exists()


@pytest.mark.parametrize("flag", ["--ckpt-dir", "--profile-dir"])
def test_metrics_naming_the_same_path_as_a_folder_output_says_so(tmp_path, refused, flag):
  """It said '--metrics X: is a folder', of a folder the run itself had just made for the other flag."""
  err = refused(*(["--steps", "20"] if flag == "--profile-dir" else []), flag, str(tmp_path / "out"), "--metrics",
                str(tmp_path / "out"))
  assert f"--metrics {tmp_path / 'out'} is also {flag}, a folder: give --metrics a file of its own" in err, err
  assert not (tmp_path / "out").exists()
