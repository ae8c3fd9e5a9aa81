"""Which step folders in a checkpoint folder this program wrote, and whether they are intact.

A step is saved by orbax into `<step>.saving`, then `attnlayers.json` (the manifest: size and
sha256 of every file orbax wrote, and the step) is written into it, and only then is the folder
renamed to `<step>`. So a folder is ours when it carries a manifest, and intact when it holds
exactly the files it lists, with the recorded sizes and hashes, under the name of the step it
records. Before orbax starts, `attnlayers.saving` names the step being saved; a save that was
stopped leaves it, and only the `<step>.saving` folders of the step it names are deleted (with
orbax's temporary `.orbax-checkpoint-tmp` ones). Rotation deletes only older steps that carry a
manifest, and never in place (a step folder part deleted would have lost its manifest, and with
it the mark that it is ours): `attnlayers.removing` names a free `<step>.removing` folder, the
step is renamed to it (atomic: the step is whole under its name, or gone from it), and only then
deleted; a deletion that was stopped is finished on the next start, for the folder the journal
names alone. Nothing else is ever deleted: damaged steps, and numeric folders left empty, are
renamed to `<step>.corrupt-<n>` for a person to look at; folders and files without a manifest
are left alone. Step names are canonical decimals (`7`, not `007`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil

MANIFEST = "attnlayers.json"
FORMAT = "attnlayers-checkpoint"  # the manifest's "format" value; "version" is 1
SAVING = ".saving"  # suffix of a step folder still being written
JOURNAL = "attnlayers.saving"  # the step being saved, written before orbax starts and removed once it is sealed
REMOVING = ".removing"  # suffix of an old step's folder that rotation is deleting
REMOVAL_JOURNAL = "attnlayers.removing"  # that folder's name, written before the step is renamed to it
STEP = r"0|[1-9]\d*"  # a step's folder name
ORBAX_ITEMS = ("_CHECKPOINT_METADATA", "state", "meta", "fp8")  # what orbax writes into a step's folder


@dataclasses.dataclass(frozen=True)
class Listing:
  ours: tuple[int, ...]  # steps whose folder carries a manifest, oldest first (not yet verified)
  empty: tuple[int, ...]  # numeric folders with nothing in them: what is left of a step emptied by accident
  foreign: tuple[int, ...]  # numeric folders with files but no manifest, and numeric files: not ours, never touched
  unfinished: tuple[str, ...]  # `<step>.saving...` folders: a stopped save's, if JOURNAL names their step
  removing: tuple[str, ...]  # `<step>.removing[-<n>]` folders: a stopped rotation's, if REMOVAL_JOURNAL names it


def step_path(directory: str, step: int) -> str:
  return os.path.join(directory, str(step))


def listing(directory: str) -> Listing:
  ours, empty, foreign, unfinished, removing = [], [], [], [], []
  for name in os.listdir(directory) if os.path.isdir(directory) else []:
    path = os.path.join(directory, name)
    if not os.path.isdir(path):
      if re.fullmatch(STEP, name):  # a file where a step would be saved
        foreign.append(int(name))
      continue
    if re.fullmatch(f"({STEP}){re.escape(SAVING)}(\\.orbax-checkpoint-tmp.*)?", name):
      unfinished.append(name)
    elif _removal_step(name) is not None:
      removing.append(name)
    elif re.fullmatch(STEP, name):
      kind = ours if os.path.lexists(os.path.join(path, MANIFEST)) else foreign if os.listdir(path) else empty
      kind.append(int(name))
  return Listing(tuple(sorted(ours)), tuple(sorted(empty)), tuple(sorted(foreign)), tuple(sorted(unfinished)),
                 tuple(sorted(removing)))


def _removal_step(name: str) -> int | None:
  """The step of a `<step>.removing` or `<step>.removing-<n>` name (n >= 2), else None."""
  match = re.fullmatch(f"({STEP}){re.escape(REMOVING)}(-[2-9]|-[1-9]\\d+)?", name)
  return int(match[1]) if match else None


def holds_orbax_items(folder: str) -> bool:
  """Whether `folder` holds any of ORBAX_ITEMS: a numeric folder without a manifest that does may be what is left
  of a step an attnlayers from before REMOVAL_JOURNAL was stopped deleting (it deleted in place)."""
  return any(os.path.lexists(os.path.join(folder, name)) for name in ORBAX_ITEMS)


def _files(folder: str) -> list[str]:
  """Every file under `folder` but the manifest, as sorted '/'-separated relative paths."""
  out = []
  for root, _, names in os.walk(folder):
    out += [os.path.relpath(os.path.join(root, n), folder).replace(os.sep, "/") for n in names]
  return sorted(f for f in out if f != MANIFEST)


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def write_manifest(folder: str, step: int) -> None:
  """Records every file in `folder`; written last, through a temporary file, so it is whole or absent."""
  files = {f: {"bytes": os.path.getsize(os.path.join(folder, f)), "sha256": _sha256(os.path.join(folder, f))}
           for f in _files(folder)}
  _write_whole(os.path.join(folder, MANIFEST), json.dumps({"format": FORMAT, "version": 1, "step": step,
                                                           "files": files}, indent=1))


def _write_whole(path: str, text: str) -> None:
  """`text` into `path` through a synced temporary file and a rename: the file is whole or absent; its folder is
  synced too, so that a rename after this one (a journal's step's) cannot reach the disk before it does."""
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)
  folder = os.open(os.path.dirname(path), os.O_RDONLY)
  try:
    os.fsync(folder)
  finally:
    os.close(folder)


def problem(folder: str) -> str | None:
  """None if the step in `folder` (named by its step) is intact, else what is wrong, naming the file."""
  path = os.path.join(folder, MANIFEST)
  try:
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
    files = manifest["files"]
    if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
      raise ValueError("not an attnlayers checkpoint manifest")
    if str(manifest.get("step")) != os.path.basename(folder):
      return (f"{path} records step {manifest.get('step')!r}, but the folder is named {os.path.basename(folder)} "
              "(copied or renamed)")
  except FileNotFoundError:
    return f"{path} is missing (the folder is empty)" if not os.listdir(folder) else f"{path} is missing"
  except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
    return f"{path} is unreadable ({e})"
  for name, want in files.items():
    file = os.path.join(folder, name)
    if not os.path.isfile(file):
      return f"{file} is missing"
    size = os.path.getsize(file)
    if size != want["bytes"]:
      return f"{file} has {size} bytes, {want['bytes']} when it was saved (truncated or overwritten)"
    if _sha256(file) != want["sha256"]:
      return f"{file} has changed since it was saved (its sha256 differs from the manifest's)"
  extra = sorted(set(_files(folder)) - set(files))
  if extra:
    return f"{os.path.join(folder, extra[0])} is not in {MANIFEST} (added after the step was saved)"
  return None


def set_aside(directory: str, step: int) -> str:
  """Renames step `step` to the first free `<step>.corrupt-<n>`; returns the new path."""
  n = 1
  while os.path.lexists(os.path.join(directory, f"{step}.corrupt-{n}")):
    n += 1
  new = os.path.join(directory, f"{step}.corrupt-{n}")
  os.rename(step_path(directory, step), new)
  return new


def saving_path(directory: str, step: int) -> str:
  return os.path.join(directory, f"{step}{SAVING}")


def finish(directory: str, step: int) -> None:
  """Seals a step orbax has written into `<step>.saving`: manifest, then the rename that publishes it."""
  write_manifest(saving_path(directory, step), step)
  os.rename(saving_path(directory, step), step_path(directory, step))


def begin(directory: str, step: int) -> None:
  """Records that `step` is being saved (JOURNAL), whole or absent, before orbax writes anything."""
  _write_whole(os.path.join(directory, JOURNAL), f"{step}\n")


def end(directory: str) -> None:
  os.remove(os.path.join(directory, JOURNAL))


def remove_unfinished(directory: str, names: tuple[str, ...]) -> tuple[list[str], list[str]]:
  """Deletes the `<step>.saving...` folders of the step JOURNAL names (a save this program began and did not
  finish), then the journal; returns (deleted, left): the others are not known to be ours and stay."""
  try:
    with open(os.path.join(directory, JOURNAL), encoding="utf-8") as f:
      step = f.read().strip()
  except FileNotFoundError:
    step = None
  except (OSError, UnicodeDecodeError):  # not a journal this program wrote whole: trust no name in it
    return [], list(names)
  ours = [n for n in names if step is not None and n.split(".", 1)[0] == step]
  for name in ours:
    shutil.rmtree(os.path.join(directory, name))
  if step is not None:
    end(directory)
  return ours, [n for n in names if n not in ours]


def rotate(directory: str, keep: int) -> list[int]:
  """Deletes all but the newest `keep` steps that carry a manifest; returns the deleted steps."""
  old = listing(directory).ours[:-keep]
  for step in old:
    _remove_step(directory, step)
  return list(old)


def _remove_step(directory: str, step: int) -> None:
  """Deletes step `step` through a `<step>.removing` folder REMOVAL_JOURNAL names first: stopped anywhere, it
  leaves the step whole under its name, or a folder finish_removal deletes, never a step without its manifest."""
  name, n = f"{step}{REMOVING}", 2
  while os.path.lexists(os.path.join(directory, name)):  # someone's folder of that name: not ours to replace
    name, n = f"{step}{REMOVING}-{n}", n + 1
  _write_whole(os.path.join(directory, REMOVAL_JOURNAL), f"{name}\n")
  os.rename(step_path(directory, step), os.path.join(directory, name))
  shutil.rmtree(os.path.join(directory, name))
  os.remove(os.path.join(directory, REMOVAL_JOURNAL))


def finish_removal(directory: str, names: tuple[str, ...]) -> tuple[list[str], list[str]]:
  """Deletes the `<step>.removing` folder REMOVAL_JOURNAL names (an old step this program was deleting in
  rotation when it was stopped), then the journal; returns (deleted, left) of `names` (listing's `removing`):
  the others are not known to be ours and stay. A named folder whose step folder exists too stays: the step was
  never renamed to it (rotation was stopped before), so that folder is someone else's."""
  try:
    with open(os.path.join(directory, REMOVAL_JOURNAL), encoding="utf-8") as f:
      named = f.read().strip()
  except (OSError, UnicodeDecodeError):  # none (FileNotFoundError), or not one this program wrote whole
    return [], list(names)
  step = _removal_step(named)
  ours = [named] if named in names and step is not None and not os.path.lexists(step_path(directory, step)) else []
  for name in ours:
    shutil.rmtree(os.path.join(directory, name))
  os.remove(os.path.join(directory, REMOVAL_JOURNAL))
  return ours, [n for n in names if n not in ours]


LOCK_FILE = "attnlayers.lock"  # train.lock's LOCK_NAME: a run's lock file, left empty once it is released
# what a step's folder is named: `7`, `7.saving...`, `7.removing[-n]`, `7.corrupt-n`
_STEP_NAME = f"({STEP})({re.escape(SAVING)}.*|{re.escape(REMOVING)}(-\\d+)?|\\.corrupt-\\d+)?"


def holds_run(folder: str) -> bool:
  """Whether the existing folder `folder` holds a checkpointed run of this program: a sealed step, the run's lock
  file, a save or rotation journal, or a step folder a stopped save, a rotation or a set-aside left."""
  names = os.listdir(folder)
  if {LOCK_FILE, JOURNAL, REMOVAL_JOURNAL} & set(names):
    return True
  found = listing(folder)
  return bool(found.ours or found.unfinished or found.removing) or any(
      re.fullmatch(f"({STEP})\\.corrupt-\\d+", n) for n in names)


def runs_own_file(path: str, ckpt_dir: str | None = None) -> bool:
  """Whether `path` names a file a checkpointed run keeps for itself in its folder (its lock file, which is emptied
  on release, a journal, or a step's name): in `ckpt_dir`, or in an existing folder that holds_run. Another file
  written there would be emptied, read as a journal, or taken for a step."""
  parent, name = os.path.split(os.path.realpath(path))
  ours = name in (LOCK_FILE, JOURNAL, REMOVAL_JOURNAL) or re.fullmatch(_STEP_NAME, name) is not None
  in_run = ckpt_dir is not None and parent == os.path.realpath(ckpt_dir) or os.path.isdir(parent) and holds_run(parent)
  return ours and in_run


def step_folder_at(path: str) -> str | None:
  """The step folder of a checkpointed run that `path` is, or lies in (a file or folder, existing or not), else
  None: a folder holding MANIFEST, or one named as a step (`7`, `7.saving`, `7.removing`, `7.corrupt-1`) in a folder
  that holds_run. A run that wrote there would damage that step, or be read as part of it."""
  path = os.path.realpath(path)
  while True:
    parent, name = os.path.split(path)
    if os.path.isdir(path) and os.path.lexists(os.path.join(path, MANIFEST)):
      return path
    if re.fullmatch(_STEP_NAME, name) and os.path.isdir(parent) and holds_run(parent):
      return path
    if parent == path:
      return None
    path = parent
