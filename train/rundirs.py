"""The folders of runs started without --ckpt-dir: one per run under RUNS, named by its start time, and RUNS/latest,
which names the newest finished one for python -m sample.
"""

from __future__ import annotations

import os
import time

import jax

from train import hosts, undo

RUNS = "runs"  # where runs without --ckpt-dir keep their checkpoints, one folder each
LATEST = os.path.join(RUNS, "latest")  # the name of the newest finished one, for python -m sample


def fresh_run_dir() -> str:
  """A new folder under RUNS for a new run, named by its start time, made here: os.mkdir fails where the name
  exists, so two runs started in the same second each get a folder of their own (the second "-2")."""
  base = os.path.join(RUNS, "train-" + time.strftime("%Y%m%d-%H%M%S"))
  os.makedirs(RUNS, exist_ok=True)
  path, n = base, 2
  while True:
    try:
      os.mkdir(path)
      return path
    except FileExistsError:
      path, n = f"{base}-{n}", n + 1
    except FileNotFoundError:  # a refused run that had made RUNS removed it, empty, since: make it again
      os.makedirs(RUNS, exist_ok=True)


class RunDirError(RuntimeError):
  """The run's own folder could not be made (on process 0); every process raises it, with process 0's reason."""


def agreed_run_dir() -> tuple[str, list[str]]:
  """The folder fresh_run_dir makes on process 0, on every process (they must save to one folder), and the folders
  above it process 0 made (RUNS, where it was not there; [] on the others); where process 0 cannot make it,
  RunDirError on every process (hosts.on_process_0 sends the failure as it would the path)."""
  made = []

  def make() -> str:
    try:
      made.extend(undo.make_dirs(RUNS))
      return fresh_run_dir()
    except OSError as e:
      undo.remove_empty(made)
      raise RunDirError(f"cannot make a run folder in {RUNS}/ ({e.strerror or e}); give --ckpt-dir elsewhere, or "
                        "--no-ckpt") from None
  return hosts.on_process_0(make, errors=(RunDirError,), default=RunDirError), made


def discard_if_unused(path: str, above: list[str]) -> list[str]:
  """Removes a run folder fresh_run_dir made for this run where it is empty (the run failed or was stopped before
  saving; its checkpoints removed the lock file they made, while they held the lock), then the folders above it
  that agreed_run_dir made (`above`), where empty; returns those it removed. A lock file still there stays: the
  lock is released by now, so it may be another trainer's."""
  if jax.process_index() == 0:
    return undo.remove_empty(above + [os.path.abspath(path)])  # innermost first
  return []


def write_latest(path: str) -> None:
  """Names `path` (a folder in RUNS) in RUNS/latest, replacing the file whole."""
  with open(LATEST + ".tmp", "w", encoding="utf-8") as f:
    f.write(os.path.basename(path) + "\n")
  os.replace(LATEST + ".tmp", LATEST)
