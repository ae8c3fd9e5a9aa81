"""What a run made on disk before it was refused, so that it can remove exactly that again.

A run refused before it trains (data its vocabulary cannot hold, another run's checkpoint, a backend
that cannot run), or stopped by a signal before its first step, leaves the disk as it found it: the
folders it made on the way to --ckpt-dir, runs/ or --profile-dir go, and so do the files it created
and left empty (the metrics file, the lock). Only what this process made is removed, and only while
it is empty: os.rmdir refuses a folder with anything in it, so one that someone else filled in the
meantime stays, with the folders above it.
"""

from __future__ import annotations

import os


def make_dirs(path: str) -> list[str]:
  """Makes folder `path` and the missing ones above it, as os.makedirs(path, exist_ok=True) does (FileExistsError
  where a file is in the way); returns those this call made, absolute, outermost first. Where it fails part-way,
  the ones it made are removed again."""
  missing, head = [], os.path.abspath(path)
  while not os.path.isdir(head):  # ends at the root, a folder
    missing.append(head)
    head = os.path.dirname(head)
  made = []
  try:
    for folder in reversed(missing):
      try:
        os.mkdir(folder)
        made.append(folder)
      except FileExistsError:  # made by another process since, or a file in the way
        if not os.path.isdir(folder):
          raise
  except OSError:
    remove_empty(made)
    raise
  return made


def remove_empty(folders: list[str]) -> list[str]:
  """Removes `folders` (as make_dirs returns them), innermost first, while they are empty: the first that is not
  stays, and so do the folders above it. Returns those it removed."""
  removed = []
  for folder in reversed(folders):
    try:
      os.rmdir(folder)
    except OSError:  # not empty (or already gone): it and its parents are not ours to remove
      break
    removed.append(folder)
  return removed


def is_open_at(fd: int, path: str) -> bool:
  """Whether `path` still names the file open as `fd` (it was neither removed nor replaced since it was opened)."""
  try:
    there = os.stat(path)
  except OSError:
    return False
  here = os.fstat(fd)
  return (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino)
