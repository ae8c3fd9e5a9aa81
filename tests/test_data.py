"""train.data's checks of what --data names, and how it loads: data must look like data (text, or token shards whose
ids fit the model), a device or pipe is not data, and a large load shows progress and holds the data once."""

import contextlib
import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import models
from train import cli, data, loop

TEXT = "def f(x):\n  return x + 1  # café, naïve\n" * 200  # text with some UTF-8 beyond ASCII


def write_shard(path, tokens):
  header = np.zeros(data.SHARD_HEADER_INTS, np.int32)
  header[:3] = (data.SHARD_MAGIC, 1, len(tokens))
  path.write_bytes(header.tobytes() + np.asarray(tokens, np.uint16).tobytes())


@pytest.mark.parametrize("target", ["missing", "loop"])
def test_a_link_to_nothing_is_named_as_a_link(tmp_path, target):
  """A dangling or looping symbolic link said "no such file or folder" of a path that is there, as a link."""
  if target == "missing":
    os.symlink(tmp_path / "gone.txt", tmp_path / "link")
  else:
    os.symlink(tmp_path / "other", tmp_path / "link")
    os.symlink(tmp_path / "link", tmp_path / "other")
  with pytest.raises(FileNotFoundError, match=f"--data '{tmp_path}/link' is a symbolic link to '{tmp_path}/"
                     f"{'gone.txt' if target == 'missing' else 'other'}', which does not exist"):
    data.check_source(str(tmp_path / "link"))


def test_a_pattern_of_text_files_says_that_patterns_read_shards_and_folders_text(tmp_path):
  """'DIR/*.txt' said "no such file or folder (give ... 'DIR/*.bin')" of a pattern that matches files."""
  (tmp_path / "a.txt").write_text(TEXT)
  with pytest.raises(FileNotFoundError, match=f"--data '{tmp_path}/\\*.txt' is a pattern, and a pattern reads llm.c "
                     f"token shards \\('DIR/\\*.bin'\\) only: give a text file, or the folder '{tmp_path}'"):
    data.check_source(str(tmp_path / "*.txt"))
  with pytest.raises(FileNotFoundError, match="no such file or folder"):  # a pattern that matches nothing
    data.check_source(str(tmp_path / "*.md"))


def test_a_folder_of_devices_only_says_what_it_holds(tmp_path):
  """A folder holding pipes (/dev: devices) but no file was 'an empty folder'."""
  os.mkfifo(tmp_path / "fifo")
  with pytest.raises(ValueError, match=f"--data '{tmp_path}' holds no files of data, only 1 device\\(s\\), pipe"):
    data.load(str(tmp_path), 16)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_a_file_that_reports_no_size_but_holds_bytes_is_not_called_empty():
  with pytest.raises(ValueError, match="'/proc/self/status' reports a size of 0 but holds bytes .*copy it to a file"):
    data.load("/proc/self/status", 16)


def test_a_character_device_is_refused_as_not_data():
  with pytest.raises(ValueError, match="'/dev/zero' is a character device, not a file of data: give a text file"):
    data.load("/dev/zero", 32)


def test_a_pipe_is_refused_as_not_data(tmp_path):
  os.mkfifo(tmp_path / "fifo")
  with pytest.raises(ValueError, match="fifo' is a pipe, not a file of data"):
    data.check_source(str(tmp_path / "fifo"))


@pytest.mark.parametrize("make", [
    lambda: open(sys.executable, "rb").read(1 << 20),  # an executable
    lambda: np.random.default_rng(0).bytes(200_000),  # random (or compressed) bytes
], ids=["executable", "random"])
def test_a_file_that_is_mostly_not_text_is_refused_with_its_name(tmp_path, make):
  (tmp_path / "blob.txt").write_bytes(make())
  with pytest.raises(ValueError, match=r"blob.txt' is mostly not text: \d+% of the bytes .*--data-raw-bytes"):
    data.load(str(tmp_path / "blob.txt"), 32)
  assert data.load(str(tmp_path / "blob.txt"), 32, raw_bytes=True).train  # the flag trains on its bytes


def test_a_folder_with_files_that_are_not_text_names_them(tmp_path):
  for i in range(3):
    (tmp_path / f"a{i}.py").write_text(TEXT)
  (tmp_path / "noise.dat").write_bytes(np.random.default_rng(0).bytes(50_000))
  with pytest.raises(ValueError, match=r"holds 1 file\(s\) that are mostly not text .*noise.dat \(\d+%\)"):
    data.load(str(tmp_path), 32)
  assert data.load(str(tmp_path), 32, raw_bytes=True).train


def test_text_with_some_latin1_or_control_bytes_still_loads(tmp_path):
  (tmp_path / "t.txt").write_bytes(TEXT.encode("latin-1") + b"\x00\x07" * 20)
  assert data.load(str(tmp_path / "t.txt"), 32).train


def test_the_raw_bytes_flag_reaches_the_config():
  assert cli.parse(["--data-raw-bytes"]).data_raw_bytes and not cli.parse([]).data_raw_bytes


@pytest.mark.parametrize("make, message", [
    (lambda d: "/dev/zero", "error: --data '/dev/zero' is a character device, not a file of data"),
    (lambda d: d / "noise.txt", "noise.txt' is mostly not text"),
], ids=["device", "not-text"])
def test_the_trainer_refuses_data_that_is_not_data_and_keeps_no_folder(tmp_path, make, message):
  (tmp_path / "noise.txt").write_bytes(np.random.default_rng(0).bytes(50_000))
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as e:
    cli.main(["--preset", "tiny", "--seq-len", "32", "--steps", "1", "--no-progress", "--data", str(make(tmp_path)),
              "--ckpt-dir", str(tmp_path / "c")])
  assert e.value.code == 2 and message in err.getvalue() and "Traceback" not in err.getvalue(), err.getvalue()
  assert not (tmp_path / "c").exists()


def test_shards_with_ids_past_the_vocabulary_are_refused_at_load_with_the_file_and_largest_id(tmp_path):
  write_shard(tmp_path / "train_000.bin", np.arange(1000) % 50000)
  write_shard(tmp_path / "train_001.bin", np.r_[np.arange(999), 60001])
  write_shard(tmp_path / "val_000.bin", np.arange(500) + 7)
  pattern = str(tmp_path / "*.bin")
  with pytest.raises(ValueError, match=r"1 shard\(s\) hold token ids outside --vocab-size 50304 \(ids 0 to 50303\): "
                                       r".*train_001.bin holds token id 60001\. .*--vocab-size 60002 or larger"):
    data.load(pattern, 32, vocab_size=50304)
  assert data.load(pattern, 32, vocab_size=60002).train


def test_the_trainer_refuses_shard_ids_past_its_vocabulary_before_building_a_model(tmp_path, monkeypatch):
  write_shard(tmp_path / "train_000.bin", np.r_[np.arange(999), 50400])
  write_shard(tmp_path / "val_000.bin", np.arange(500) + 7)
  monkeypatch.setattr(loop, "build", lambda *a, **k: pytest.fail("built a model before refusing the data"))
  cfg = loop.TrainConfig(model=models.preset("tiny", seq_len=32, vocab_size=50304), steps=2, batch_size=2,
                         eval_every=0, sample_tokens=0, progress=False, data=str(tmp_path / "*.bin"))
  with pytest.raises(ValueError, match="train_000.bin holds token id 50400"):
    loop.run(cfg)


@pytest.mark.parametrize("split", ["folder", "shards"])
def test_a_load_shows_its_progress(tmp_path, monkeypatch, capsys, split):
  monkeypatch.setattr(data, "PROGRESS_DELAY", 0)  # a bar at once, as a large load shows after PROGRESS_DELAY
  if split == "folder":
    for i in range(3):
      (tmp_path / f"a{i}.py").write_text(TEXT)
    spec, kw, says = str(tmp_path), {}, "reading --data"
  else:
    write_shard(tmp_path / "train_000.bin", np.arange(1000))
    write_shard(tmp_path / "val_000.bin", np.arange(500))
    spec, kw, says = str(tmp_path / "*.bin"), {"vocab_size": 50304}, "checking --data's token ids"
  data.load(spec, 32, progress=True, **kw)
  assert says in capsys.readouterr().err
  data.load(spec, 32, progress=False, **kw)
  assert says not in capsys.readouterr().err


PEAK = textwrap.dedent("""
  import sys
  from train import data
  def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
  def load(spec):
    d = data.load(spec, 256, progress=True)
    d.batch("train", 0, 0, 4, 256), d.batch("val", 0, 0, 4, 256), d.content()
  load(sys.argv[2])  # a small load first: what any load imports or sets up once is not the data's
  open("/proc/self/clear_refs", "w").write("5")  # the peak resets to the memory held now
  before = rss("VmRSS")
  load(sys.argv[1])
  print(rss("VmHWM") - before)
""")


@pytest.mark.parametrize("files", [1, 3, 12])
def test_a_large_load_holds_the_data_once(tmp_path, files):
  """The peak host memory a load adds, measured in a process of its own, stays below 1.2x the data's size."""
  folder = tmp_path / "d"
  folder.mkdir()
  line = b"the quick brown fox jumps over the lazy dog 0123456789\n"
  size = 64 << 20
  for i in range(files):
    (folder / f"t{i:02}.txt").write_bytes(line * (size // files // len(line)))
  spec = str(folder / "t00.txt") if files == 1 else str(folder)
  (tmp_path / "small.txt").write_text(TEXT)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", PEAK, spec, str(tmp_path / "small.txt")], cwd=root, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert int(out.stdout.split()[-1]) < 1.2 * size, (int(out.stdout.split()[-1]) / size, out.stderr)
