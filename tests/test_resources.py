"""Resource failures end in one line saying what ran out, how much was asked and what to lower, with nothing written
damaged: device or host memory (the trainer, the sampler, python -m attnlayers) and a full disk while saving."""

import logging
import os
import shutil
import sys
import types

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

import attnlayers.__main__ as attnlayers_main
from attnlayers import device
from sample import cli as sample_cli
from tests.test_train_faults import TINY, loop, tiny, train_cli
from train import checkpoint, cli, diskspace, stepdirs


@pytest.fixture(scope="module")
def out_of_memory() -> jax.errors.JaxRuntimeError:
  """XLA's own error for an allocation the machine cannot give (128 TiB)."""
  try:
    jnp.zeros((2**47,), jnp.uint8).block_until_ready()
  except jax.errors.JaxRuntimeError as e:
    return e
  pytest.fail("a 128 TiB allocation succeeded")


def one_error_line(err: str) -> str:
  lines = [line for line in err.splitlines() if line.strip()]
  assert "Traceback" not in err and lines[-1].startswith("error: "), err
  assert not any("Event loop is closed" in line or "No space left" in line for line in lines[:-1]), err
  return lines[-1]


def test_out_of_memory_reads_xla_and_its_allocators_wordings(out_of_memory):
  assert device.out_of_memory(out_of_memory).startswith(f"out of memory on {device.current().describe()}: 128 TiB "
                                                        "asked")
  for message in ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 103079215104 bytes.",
                  "RESOURCE_EXHAUSTED: Failed to allocate request for 96.00GiB (103079215104B) on device ordinal 0"):
    assert "96 GiB asked" in device.out_of_memory(jax.errors.JaxRuntimeError(message))
  assert device.out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: something else")) is None
  assert device.out_of_memory(ValueError("RESOURCE_EXHAUSTED: Out of memory")) is None  # not XLA's error


def trainer_stopped_by(error, tmp_path, monkeypatch, capsys) -> tuple[int, str]:
  """The exit code and the one error line of a tiny naive run whose step raises `error`; the folder the run made,
  empty, is gone."""
  def step(*args, **kwargs):
    raise error
  monkeypatch.setattr(loop, "_train", step)
  with pytest.raises(SystemExit) as stop:
    cli.main([*TINY, "--steps", "2", "--attn", "naive", "--ckpt-dir", str(tmp_path / "c")])
  assert not (tmp_path / "c").exists()
  return stop.value.code, one_error_line(capsys.readouterr().err)


def test_a_trainer_out_of_memory_is_one_line_naming_the_flags(tmp_path, monkeypatch, capsys, out_of_memory):
  code, line = trainer_stopped_by(out_of_memory, tmp_path, monkeypatch, capsys)
  assert code == 1
  assert line.startswith("error: out of memory on ") and "128 TiB asked" in line, line
  assert line.endswith("lower --batch-size, --seq-len or --vocab-size (--attn naive builds the (B, N, T, T) "
                       "attention scores; --attn auto, cudnn or te do not)"), line


@pytest.mark.slow
def test_a_batch_too_large_for_the_machine_is_one_line(tmp_path):
  """XLA's own allocation failure, end to end: 4M rows of 32 tokens ask for terabytes."""
  code, _, err = train_cli([*TINY, "--batch-size", str(2**22), "--steps", "2", "--no-ckpt"])
  line = one_error_line(err)
  assert code == 1 and line.startswith("error: out of memory on ") and "TiB asked" in line, err


def test_a_sampler_out_of_memory_is_one_line(monkeypatch, capsys, out_of_memory):
  def run(a):
    raise out_of_memory
  monkeypatch.setattr(sample_cli, "run", run)
  with pytest.raises(SystemExit) as stop:
    sample_cli.main(["--batch", "100000"])
  line = one_error_line(capsys.readouterr().err)
  assert stop.value.code == 1 and "128 TiB asked" in line and line.endswith("lower --batch (the samples drawn "
                                                                            "together) or --tokens"), line


def test_attnlayers_refuses_a_reference_larger_than_the_host(monkeypatch, capsys):
  monkeypatch.setattr(device, "host_memory", lambda field="MemAvailable": 2**30)
  with pytest.raises(SystemExit) as stop:
    attnlayers_main.main(["--seq-len", "4096"])  # 3 x (2, 8, 4096, 4096) float64: 6 GiB
  line = one_error_line(capsys.readouterr().err)
  assert stop.value.code == 2 and "needs about 6.12 GiB of host memory" in line and "1 GiB available" in line, line


def test_attnlayers_counts_the_head_dim_in_the_reference_it_refuses(monkeypatch, capsys):
  """--head-dim 100000000: the (B, N, T, S) count passed it, and jax aborted the process (a C++ check failure, exit
  134) while making q, k and v of hundreds of GiB."""
  monkeypatch.setattr(device, "host_memory", lambda field="MemAvailable": 2**30)
  with pytest.raises(SystemExit) as stop:
    attnlayers_main.main(["--seq-len", "16", "--head-dim", "1000000"])  # 4 x (2, 16, 8, 10**6) float64: 7.6 GiB
  line = one_error_line(capsys.readouterr().err)
  assert stop.value.code == 2 and "needs about 7.63 GiB of host memory" in line and "--head-dim" in line, line


def test_attnlayers_reports_a_backend_out_of_memory_as_its_row(monkeypatch, capsys, out_of_memory):
  real = attnlayers_main.attnlayers.attention

  def attention(q, k, v, *, backend, **kwargs):
    if backend == "naive":
      raise out_of_memory
    return real(q, k, v, backend=backend, **kwargs)
  monkeypatch.setattr(attnlayers_main.attnlayers, "attention", attention)
  attnlayers_main.main(["--seq-len", "16", "--dtype", "float32"])
  rows = capsys.readouterr().out.splitlines()
  naive = next(r for r in rows if r.strip().startswith("naive"))
  assert "out of memory on" in naive and "(it builds the (B, N, T, S) scores): lower --seq-len" in naive, rows
  assert any(r.strip().startswith("xla  ok") for r in rows), rows  # the other backends still run


CUDNN_FAILURE = jax.errors.JaxRuntimeError("INTERNAL: cuDNN graph failed to build: CUDNN_STATUS_NOT_SUPPORTED\n"
                                           "  in the fused attention custom call")  # XLA's wording of a kernel's error


def test_an_xla_failure_other_than_memory_is_one_line(tmp_path, monkeypatch, capsys):
  """A kernel XLA cannot build ends the trainer, the sampler and python -m attnlayers's row in one line with XLA's
  status, not in JAX's traceback."""
  assert device.xla_failure(ValueError("INTERNAL: x")) is None
  assert device.xla_failure(CUDNN_FAILURE) == (f"XLA failed on {device.current().describe()}: INTERNAL: cuDNN graph "
                                               "failed to build: CUDNN_STATUS_NOT_SUPPORTED")

  code, line = trainer_stopped_by(CUDNN_FAILURE, tmp_path, monkeypatch, capsys)
  assert code == 1 and "CUDNN_STATUS_NOT_SUPPORTED" in line and "--attn xla runs it" in line, line

  def fail(*args, **kwargs):
    raise CUDNN_FAILURE
  monkeypatch.setattr(sample_cli, "run", fail)
  with pytest.raises(SystemExit) as stop:
    sample_cli.main([])
  line = one_error_line(capsys.readouterr().err)
  assert stop.value.code == 1 and "CUDNN_STATUS_NOT_SUPPORTED" in line and "--attn xla decodes" in line, line

  real = attnlayers_main.attnlayers.attention
  monkeypatch.setattr(attnlayers_main.attnlayers, "attention",
                      lambda q, k, v, *, backend, **kw: fail() if backend == "naive" else real(q, k, v, backend=backend,
                                                                                              **kw))
  attnlayers_main.main(["--seq-len", "16", "--dtype", "float32"])
  rows = capsys.readouterr().out.splitlines()
  assert any(r.strip().startswith("naive  XLA failed on") and r.endswith("CUDNN_STATUS_NOT_SUPPORTED") for r in rows)
  assert any(r.strip().startswith("xla  ok") for r in rows), rows  # the other backends still run


def disk(free: int, total: int = 2**30):
  return lambda path: shutil._ntuple_diskusage(total, total - free, free)


def test_a_disk_without_room_for_the_first_save_stops_before_training(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(diskspace.shutil, "disk_usage", disk(2**20))
  monkeypatch.setattr(loop, "_train", lambda *a, **k: pytest.fail("trained with no room to save"))
  with pytest.raises(SystemExit) as stop:
    cli.main([*TINY, "--steps", "20", "--ckpt-every", "10", "--ckpt-dir", str(tmp_path / "c"),
              "--metrics", str(tmp_path / "m.jsonl")])
  line = one_error_line(capsys.readouterr().err)
  assert stop.value.code == 1
  assert line.startswith(f"error: disk full: {diskspace.mount(str(tmp_path))} has 1 MiB free of 1 GiB, and the "
                         "checkpoint of step 10 needs about "), line
  assert "no checkpoint of this run is in" in line and "give a --ckpt-dir on another disk" in line, line
  assert not (tmp_path / "c").exists() and not (tmp_path / "m.jsonl").exists()  # what the refused run made: gone


def test_a_disk_that_fills_while_saving_ends_in_one_line_and_keeps_the_last_step(tmp_path, monkeypatch, capsys,
                                                                                  caplog):
  """The disk fills in the middle of orbax's write of step 30: tensorstore's callbacks then report 'Event loop is
  closed' and orbax logs the failed write; the run says it once, removes the partial step and keeps 10 and 20."""
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # the run leaves its filters installed
  monkeypatch.setattr(logging.getLogger("absl"), "filters", list(logging.getLogger("absl").filters))
  loop.run(tiny(tmp_path / "c"))
  capsys.readouterr()

  def fills(self, path, **kwargs):
    os.makedirs(os.path.join(path, "state"))
    closed = RuntimeError("Event loop is closed")
    sys.unraisablehook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=closed, exc_traceback=None,
                                             err_msg=None, object=None))
    message = (f'RESOURCE_EXHAUSTED: Error writing "params" in OCDBT database at local file "{path}": Failed to '
               "write 1670696 bytes to file 18: No space left on device [os_error_code='28']")
    logging.getLogger("absl").error("_SignalingThread.run() raised an exception: %s", message)
    raise ValueError(message)
  monkeypatch.setattr(ocp.Checkpointer, "save", fills)
  with pytest.raises(SystemExit) as stop:
    cli.main([*TINY, "--steps", "40", "--ckpt-every", "10", "--allow-change", "steps",
              "--ckpt-dir", str(tmp_path / "c")])
  line = one_error_line(capsys.readouterr().err)
  assert stop.value.code == 1 and "No space left" not in caplog.text
  assert line.startswith(f"error: disk full: {diskspace.mount(str(tmp_path))} filled up (") and (
      f"while step 30 was being saved; its partial folder was removed; the newest whole checkpoint is step 20 in "
      f"{tmp_path / 'c'} (run the same command to resume from it)") in line, line
  assert sorted(os.listdir(tmp_path / "c")) == ["10", "20", "attnlayers.lock"]
  assert stepdirs.problem(str(tmp_path / "c" / "20")) is None


def test_a_save_that_fails_otherwise_keeps_its_error(tmp_path, monkeypatch):
  ckpts = checkpoint.Checkpoints(str(tmp_path / "c"))
  ckpts.checkpointer.save = lambda path, **_: (_ for _ in ()).throw(ValueError("INTERNAL: not a disk problem"))
  with pytest.raises(ValueError, match="not a disk problem"):
    ckpts.save(10, {"params": {"w": jnp.zeros(2)}}, {})
  ckpts.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a file that is always full")
def test_a_metrics_file_that_cannot_be_written_ends_in_one_line(tmp_path, capsys):
  """--metrics /dev/full: the first record's write failed in two chained OSError tracebacks (the flush, then the
  close that flushed again)."""
  with pytest.raises(SystemExit) as stop:
    cli.main([*TINY, "--steps", "2", "--no-ckpt", "--data", _text(tmp_path), "--metrics", "/dev/full"])
  line = one_error_line(capsys.readouterr().err)
  assert stop.value.code == 1 and line.startswith("error: --metrics /dev/full: cannot append a record (No space "
                                                  "left on device); the run stops here"), line


def _text(tmp_path) -> str:
  (tmp_path / "d.txt").write_text("hello world\n" * 300)
  return str(tmp_path / "d.txt")
