"""One trainer per checkpoint folder: a lock file that names its holder.

The lock is `fcntl.flock` on `<ckpt-dir>/attnlayers.lock`. The OS drops it when the holding
process ends, however it ends (SIGKILL included), so a dead trainer never blocks the next one;
the pid and host written into the file only serve the messages. A holder that exits normally
empties the file, so finding a name in a file we could lock means the holder was killed.
A run refused before it saved removes a lock file it created (DirLock.remove_made): a trainer that
opened that file just before then finds, once it has the flock, that the path no longer names
its file, and locks the file there now instead.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket

from train import undo

LOCK_NAME = "attnlayers.lock"


class LockedError(RuntimeError):
  pass


class DirLock:
  def __init__(self, directory: str):
    self.path = os.path.join(directory, LOCK_NAME)
    self.fd: int | None = None
    self.stale_holder: str | None = None  # who held the lock last without releasing it (killed), if anyone
    self.created = False  # acquire made the lock file: remove_made may remove it

  def acquire(self) -> None:
    """Takes the lock or raises LockedError naming the holder; OSError if the folder is not writable."""
    while True:
      fd, self.created = _open_or_create(self.path)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not written its name yet"
        os.close(fd)
        raise LockedError(f"{os.path.dirname(self.path)} is in use by another trainer ({holder}); "
                          "wait for it to finish, or give another --ckpt-dir") from None
      if undo.is_open_at(fd, self.path):
        break
      os.close(fd)  # its holder removed the file we opened (remove_made) before releasing it: lock the one there now
    self.stale_holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or None
    since = datetime.datetime.now().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since {since}\n".encode(), 0)
    os.fsync(fd)
    self.fd = fd

  def remove_made(self) -> list[str]:
    """Removes the lock file where acquire created it and it is still held (a run refused before it saved); the
    lock itself stays held until release. Returns [its path] where it removed it, else []."""
    if self.fd is not None and self.created and undo.is_open_at(self.fd, self.path):
      os.remove(self.path)
      return [self.path]
    return []

  def release(self) -> None:
    if self.fd is not None:
      os.ftruncate(self.fd, 0)  # a clean exit leaves no name behind
      os.close(self.fd)  # closing drops the flock
      self.fd = None


def _open_or_create(path: str) -> tuple[int, bool]:
  """The lock file opened for reading and writing, and whether this call created it."""
  try:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
  except FileExistsError:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644), False
