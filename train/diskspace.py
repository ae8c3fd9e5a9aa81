"""Room on the disk for a checkpoint: a save that cannot fit stops the run before it writes (DiskFull), and one the
disk fills while it writes ends the same way, in one line, with orbax's echoes of the failure held back.

A save needs about the state's bytes (orbax stores the arrays uncompressed) while the older steps it rotates away
are still there. The line names the disk, what was free and needed, and the newest checkpoint that is whole.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys

import jax

from attnlayers.device import size
from train.reader import CheckpointError

MARGIN = 1.05  # the state's bytes, and this much more for orbax's metadata and our manifest
SLACK = 2**20  # and at least this much


class DiskFull(CheckpointError):
  """The checkpoint folder's disk cannot hold the next save."""


def state_bytes(state) -> int:
  """Bytes of every array in `state` (a pytree)."""
  return sum(int(x.nbytes) for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))


def mount(path: str) -> str:
  """The mount point of the disk that holds `path`."""
  path = os.path.realpath(path)
  while not os.path.ismount(path):
    path = os.path.dirname(path)
  return path


def _kept(directory: str, newest: int | None) -> str:
  if newest is None:
    return f"no checkpoint of this run is in {directory} yet"
  return f"the newest whole checkpoint is step {newest} in {directory} (run the same command to resume from it)"


def check_room(directory: str, step: int, need: int, newest: int | None) -> None:
  """Raises DiskFull where the disk of `directory` has less than about `need` bytes free for step `step`."""
  usage = shutil.disk_usage(directory)
  want = int(need * MARGIN) + SLACK
  if usage.free < want:
    raise DiskFull(f"disk full: {mount(directory)} has {size(usage.free)} free of {size(usage.total)}, and the "
                   f"checkpoint of step {step} needs about {size(want)}; nothing of it was written; "
                   f"{_kept(directory, newest)}; free space on {mount(directory)} or give a --ckpt-dir on another "
                   "disk")


def is_disk_full(error: BaseException) -> bool:
  """Whether `error`, or one it was raised from, says the disk is full (an OSError, or tensorstore's message as
  orbax raises it)."""
  while error is not None:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC or "No space left on device" in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


def full_while_saving(directory: str, step: int, newest: int | None) -> DiskFull:
  usage = shutil.disk_usage(directory)
  return DiskFull(f"disk full: {mount(directory)} filled up ({size(usage.free)} free of {size(usage.total)}) while "
                  f"step {step} was being saved; its partial folder was removed; {_kept(directory, newest)}; free "
                  f"space on {mount(directory)} or give a --ckpt-dir on another disk")


class _Echoes(logging.Filter):
  """Drops orbax's log records of a write that found the disk full (the save's own error says it once)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "No space left on device" not in record.getMessage()


@contextlib.contextmanager
def quiet_when_full():
  """While a save runs: the failed writes' echoes are held back where the disk is full (orbax's log records, and
  the 'Event loop is closed' errors tensorstore's callbacks report once orbax's event loop is gone); every other
  error and record passes. Where the disk filled, the filters stay for the rest of the process, whose writer
  threads may still report."""
  previous, echoes = sys.unraisablehook, _Echoes()

  def hook(unraisable) -> None:
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
      previous(unraisable)

  sys.unraisablehook = hook
  absl = logging.getLogger("absl")  # orbax logs through absl.logging
  absl.addFilter(echoes)
  full = False
  try:
    yield
  except BaseException as e:
    full = is_disk_full(e)
    raise
  finally:
    if not full:
      sys.unraisablehook = previous
      absl.removeFilter(echoes)
