"""--data's overlap policy: a run's outputs never lie in what --data reads.

A run that writes its checkpoints, metrics file or profiler trace where --data reads would train on them at its
next start, and its checkpoints could then never be resumed (other data). `reads` says whether loading --data
reads a path, as train.data.load finds its files (sharing its data.Walk of a folder); `outputs_read_as_data` and
`runs_folder_read_as_data` are the refusals train.checks (on the flags) and train.loop.run (on its config) make before
any work.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from collections.abc import Callable

from train import data


def reads(spec: str | None, path: str, walk: data.Walk | None = None) -> bool:
  """Whether loading --data `spec` reads the file `path`, or files under the folder `path` (either may not exist
  yet): what a run must not write to, or its own output becomes its data. read_by(spec) asks it of several paths.

  Args:
    spec: --data as given (None: the standard library's top-level .py files).
    path: the path of an output.
    walk: the data.Walk of `spec` to read a folder's walk from; None: walked now.
  """
  return read_by(spec, walk)(path)


def read_by(spec: str | None, walk: data.Walk | None = None) -> Callable[[str], bool]:
  """reads(spec, ·), for every path asked with one walk of `spec`'s folder, as load walks it: `walk`'s, where given
  (data.Walk), else one made now. outputs_read_as_data checks all of a run's outputs with one."""
  if spec is None:  # the standard library's top-level .py files
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    def in_stdlib(path: str) -> bool:
      real = os.path.realpath(path)
      return os.path.dirname(real) == stdlib and real.endswith(".py")
    return in_stdlib
  if spec.endswith(".bin"):  # the files the pattern matches, as glob matches them; a folder's files never end in .bin
    return lambda path: _glob_matches(data.source(spec), os.path.realpath(path))
  folders = {os.path.realpath(spec)} | {os.path.realpath(top) for top, _ in data.walked(spec, walk)}  # a file: itself
  return lambda path: _reached(os.path.realpath(path), folders)


def _reached(path: str, folders: set[str]) -> bool:
  """Whether real path `path` is one of `folders` (the real paths of the folders a walk went through) or lies under
  one by names the walk takes (none starting with "."), so that it is read, or would be once made."""
  while path not in folders:
    parent, name = os.path.split(path)
    if parent == path or name.startswith("."):
      return False
    path = parent
  return True


def _glob_matches(pattern: str, path: str) -> bool:
  """Whether glob(pattern) (not recursive) would return real path `path`: each name matched by its part of the
  pattern ("*" never crosses "/", and a name starting with "." needs a pattern part that does)."""
  want, have = pattern.split(os.sep), path.split(os.sep)
  return len(want) == len(have) and all(
      fnmatch.fnmatchcase(h, w) and (not h.startswith(".") or w.startswith(".")) for w, h in zip(want, have))


def outputs_read_as_data(spec: str | None, walk: data.Walk | None = None, *, ckpt_dir: str | None = None,
                         metrics: str | None = None, profile_dir: str | None = None) -> list[str]:
  """The refusals of a run's outputs that lie where --data `spec` is read, one per output; [] where none does.

  Args:
    spec: --data as given.
    walk: the data.Walk of `spec` (None: walked now, where an output is given).
    ckpt_dir: --ckpt-dir (TrainConfig's field of that name), or None.
    metrics: --metrics, or None.
    profile_dir: --profile-dir, or None.
  """
  outputs = [("--ckpt-dir", ckpt_dir, "checkpoints"), ("--metrics", metrics, "metrics file"),
             ("--profile-dir", profile_dir, "profiler trace")]
  where = spec or "(default: the standard library's top-level .py files)"
  given = [(flag, path, what) for flag, path, what in outputs if path]
  read = read_by(spec, walk) if given else None  # a --data folder walked once for them all
  return [f"{flag} {path} lies in what --data {where} reads: this run's {what} would become training text on "
          f"the next start, which then could not resume (other data); give {flag} a path outside it"
          for flag, path, what in given if read(path)]


def runs_folder_read_as_data(spec: str | None, runs: str, walk: data.Walk | None = None) -> str | None:
  """The refusal of a run without --ckpt-dir whose run folder `runs` (where it would make its own folder) lies in
  what --data `spec` reads, else None: checked before the folder is made, as outputs_read_as_data checks a
  --ckpt-dir."""
  if not reads(spec, runs, walk):
    return None
  return (f"the run folder {runs}/ (where a run without --ckpt-dir keeps its checkpoints) lies in what --data {spec} "
          f"reads: this run's checkpoints would become training text on the next start, which then could not resume "
          f"(other data); give --ckpt-dir a folder outside {spec}, or --no-ckpt")
