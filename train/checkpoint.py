"""Checkpoints with orbax: model + optimizer state + step + the settings that shape the run.

Each step folder holds `state` (params and optimizer state), `meta` (step, the model's
architecture fields and attention window, seed, data source and content, packing, and the run's
trajectory settings) and, for te-fp8 runs, `fp8` (FP8 scaling state), written by orbax,
plus our manifest (train.stepdirs), which is what marks the folder as ours and lets a
restore prove it intact. A run may switch attention backend on resume: FP8 state is then
dropped, or starts afresh; FP8 state this model keeps and an earlier attnlayers did not
(te-fp8's core amax history) starts afresh, and the rest is restored. The batch of step s
depends only on (seed, s), packed or not, so the step is the data position.

Reading goes through train.reader, which python -m sample uses too; what a checkpoint that
an earlier trainer wrote means today (ABSENT_*, as_trained) is decided here. orbax's
CheckpointManager is not used: it takes every numeric folder for a step (it would rotate a
user's folder `7` away, and skip saves below a foreign `700`), while orbax's Checkpointer
writes exactly the folder it is given. A lock (train.lock) keeps a second trainer out of
the folder.
"""

from __future__ import annotations

import os
import tempfile

import jax
import numpy as np
import orbax.checkpoint as ocp

from models.config import layer_kinds
from train import data, diskspace, hosts, lock, stepdirs, undo
from train.reader import CheckpointError, Reader, say as _say


class ResumeMismatchError(ValueError):
  pass


class Checkpoints:
  def __init__(self, directory: str, *, keep: int = 3):
    """Creates `directory` if needed and locks it; raises CheckpointError or lock.LockedError."""
    self.directory = os.path.abspath(directory)
    self.keep = keep
    self.last_good: int | None = None  # the newest step this run restored after verifying it, or saved
    self.set_aside: list[str] = []  # damaged steps this run renamed, as their new paths
    self.made: list[str] = []  # folders this process made, the folder and those above it: discard_if_unused's
    self.saved = False  # this run began a save here: the folder is then a checkpoint folder, lock file and all
    self.lock = lock.DirLock(self.directory)
    hosts.on_process_0(lambda: self._open(directory), errors=(CheckpointError, lock.LockedError),
                       default=CheckpointError)  # a failure stops every process
    self.checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(  # saves; reading goes through self.reader
        state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler(), fp8=ocp.StandardCheckpointHandler()))
    self.reader = Reader(self.directory)

  def _open(self, directory: str) -> None:
    """Process 0: makes and locks the folder, probes that it can write there, and tidies what a stopped save left."""
    try:
      self.made = undo.make_dirs(self.directory)
      self.lock.acquire()
      tempfile.TemporaryFile(dir=self.directory, prefix=".attnlayers-probe-").close()  # saving will work
    except (FileExistsError, NotADirectoryError):
      raise CheckpointError(f"--ckpt-dir {directory}: not a folder (a file is in the way)") from None
    except OSError as e:
      self.lock.remove_made()
      self.lock.release()
      undo.remove_empty(self.made)
      raise CheckpointError(f"--ckpt-dir {directory}: cannot write there ({e.strerror}: {e.filename})") from None
    if self.lock.stale_holder:
      _say(f"took over {self.lock.path} from a trainer that did not release it ({self.lock.stale_holder}; "
           "no longer running)")
    found = stepdirs.listing(self.directory)
    deleted, left = stepdirs.remove_unfinished(self.directory, found.unfinished)
    for name in deleted:
      _say(f"removed {os.path.join(self.directory, name)}: a save of this program that was stopped")
    for name in left:
      _say(f"{os.path.join(self.directory, name)} is not a save {stepdirs.JOURNAL} names: it is left alone (an "
           "attnlayers from before that journal left a stopped save like this; delete it if it is one)")
    deleted, left = stepdirs.finish_removal(self.directory, found.removing)
    for name in deleted:
      _say(f"removed {os.path.join(self.directory, name)}: an old step this program was deleting (rotation keeps "
           f"the newest {self.keep}) when it was stopped")
    for name in left:
      _say(f"{os.path.join(self.directory, name)} is not a deletion {stepdirs.REMOVAL_JOURNAL} names: it is left "
           "alone (delete it if you do not need it)")
    for step in found.foreign:
      looks = stepdirs.holds_orbax_items(stepdirs.step_path(self.directory, step))
      _say(f"{stepdirs.step_path(self.directory, step)} has no {stepdirs.MANIFEST}: not a checkpoint this "
           "program wrote, so it is never restored nor deleted" + (
               f" (it holds what orbax writes: it may be an old step that an older attnlayers, one without "
               f"{stepdirs.REMOVAL_JOURNAL}, was stopped while deleting; delete it if it is one)" if looks else ""))

  def listing(self) -> stepdirs.Listing:
    return stepdirs.listing(self.directory)

  def save(self, step: int, state: dict, meta: dict) -> None:
    """Saves `step`, seals it with a manifest, then deletes all but the newest `keep` of ours."""
    for path in (stepdirs.step_path(self.directory, step), stepdirs.saving_path(self.directory, step)):
      if os.path.lexists(path):  # orbax's save would delete what is there
        raise CheckpointError(f"cannot save step {step}: {path} exists and is not a checkpoint of this run; "
                              f"move it out of {self.directory}")
    items = dict(state=ocp.args.StandardSave({k: v for k, v in state.items() if k != "fp8"}),
                 meta=ocp.args.JsonSave(meta | {"step": step}))
    if state.get("fp8"):
      items["fp8"] = ocp.args.StandardSave(state["fp8"])
    self.check_room(step, state)
    self.saved = True
    try:
      with diskspace.quiet_when_full():
        if jax.process_index() == 0:
          stepdirs.begin(self.directory, step)  # a save stopped from here on is known to be ours
        self.checkpointer.save(stepdirs.saving_path(self.directory, step), args=ocp.args.Composite(**items),
                               force=True)
        # process 0 seals and rotates; the others wait for it, and stop with its error where it fails
        hosts.on_process_0(lambda: self._seal(step), errors=(CheckpointError,), default=CheckpointError)
    except Exception as e:
      if not diskspace.is_disk_full(e):
        raise
      if jax.process_index() == 0:  # the partial folder: what it holds is of no use, and the disk needs the room
        stepdirs.remove_unfinished(self.directory, self.listing().unfinished)
      raise diskspace.full_while_saving(self.directory, step, self.last_good) from None
    self.last_good = step

  def check_room(self, step: int, state: dict) -> None:
    """Raises diskspace.DiskFull, on every process, where the folder's disk cannot hold `state` saved as `step`."""
    need = diskspace.state_bytes(state)
    hosts.on_process_0(lambda: diskspace.check_room(self.directory, step, need, self.last_good),
                       errors=(diskspace.DiskFull,), default=CheckpointError)

  def _seal(self, step: int) -> None:
    stepdirs.finish(self.directory, step)
    stepdirs.end(self.directory)
    stepdirs.rotate(self.directory, self.keep)

  def newest_intact(self) -> int | None:
    """The newest step that verifies; damaged ones (and emptied folders) are set aside first. Process 0 looks,
    every process acts on its answer (its failure included)."""
    return hosts.on_process_0(self._newest_intact, errors=(CheckpointError,), default=CheckpointError)

  def _newest_intact(self) -> int | None:
    found = self.listing()
    for step in sorted(found.ours + found.empty, reverse=True):
      folder = stepdirs.step_path(self.directory, step)
      problem = stepdirs.problem(folder)
      if problem is None:
        return step
      moved = stepdirs.set_aside(self.directory, step)
      self.set_aside.append(moved)
      _say(f"checkpoint step {step} is damaged: {problem}; set aside as {moved}")
    if self.set_aside:
      _say(f"no checkpoint in {self.directory} verifies: the run starts from step 0")
    return None

  def meta(self, step: int) -> dict:
    """What step `step` recorded about its run (check_meta reads it)."""
    return self.reader.meta(step)

  def check_resume(self, step: int, expected_meta: dict, allow_change=()) -> dict:
    """The changes `allow_change` accepts (check_meta); ResumeMismatchError if step `step` is another run's."""
    return check_meta(self.directory, step, self.meta(step), expected_meta, allow_change)

  def restore(self, step: int, like: dict) -> dict:
    """The state saved at `step`; `like` gives its structure, shapes and shardings."""
    plain = {k: v for k, v in like.items() if k != "fp8"}
    self._check_shapes(step, plain)
    state = self.reader.state(step, plain)
    if "fp8" in like:
      state["fp8"] = like["fp8"]
      if like["fp8"] and self.reader.has_fp8(step):
        state["fp8"] = self.reader.fp8(step, like["fp8"])
      elif like["fp8"]:
        _say(f"checkpoint step {step} has no FP8 scaling state (another backend wrote it): FP8 scaling starts afresh")
    self.last_good = step
    return state

  def _check_shapes(self, step: int, like: dict) -> None:
    """One line naming the first array whose shape or dtype differs, instead of orbax's dump."""
    saved = self.reader.saved(step, "state")
    want = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(jax.tree.map(ocp.utils.to_shape_dtype_struct, like),
                                                         keep_empty_nodes=True))
    describe = lambda x: f"{tuple(x.shape)} {np.dtype(x.dtype).name}" if hasattr(x, "shape") else "absent"
    diffs = [".".join(map(str, k)) + f": checkpoint {describe(saved.get(k))}, now {describe(want.get(k))}"
             for k in sorted(set(saved) | set(want), key=str) if describe(saved.get(k)) != describe(want.get(k))]
    if diffs:
      more = f" (and {len(diffs) - 1} more arrays differ)" if len(diffs) > 1 else ""
      raise ResumeMismatchError(f"cannot resume from {self.directory} (step {step}): its arrays do not fit this "
                                f"model: {diffs[0]}{more}")

  def discard_if_unused(self) -> list[str]:
    """Where this process holds the lock and this run saved nothing (it failed before saving, e.g. refused, or was
    stopped before its first step), removes what opening the folder made: the lock file, if it created it, then
    the folders it made (the folder and those above it), where empty. A folder that existed, what is in it, and
    another trainer's folder or lock, stay. Returns what it removed."""
    if jax.process_index() == 0 and self.lock.fd is not None and not self.saved:
      return self.lock.remove_made() + undo.remove_empty(self.made)
    return []

  def close(self) -> None:
    self.checkpointer.close()
    self.reader.close()
    self.lock.release()


# What a checkpoint written before a meta key existed meant by its absence: it trained unpacked, its model had
# biases, its learning rate warmed up from 0 and decayed to lr / 10 a step after its last (train.optim.LR_SCHEDULE
# since), and its weight decay applied to every parameter of 2 or more dimensions (train.optim.DECAY_RULE since).
ABSENT_META = {"pack": False}
ABSENT_MODEL = {"bias": True}
ABSENT_RUN = {"lr_schedule": "warm-up lr * s / warmup, cosine to lr / 10 after the last step",
              "decay_rule": "every parameter of 2 or more dimensions (the q/k/v biases too)"}
ABSENT_FIELDS = {"model": ABSENT_MODEL, "run": ABSENT_RUN}  # by the meta key whose dict holds them


def as_trained(arch: dict) -> tuple[dict, str]:
  """A checkpoint's architecture (GPTConfig.architecture) as its model ran, and a note where that is not what it
  records (else ""). An earlier trainer accepted two window patterns GPTConfig now refuses: one with more entries
  than layers, whose extra entries applied to no layer (it reads as its first n_layer entries), and one that makes
  none of the layers local, so the window applied to no layer and that model trained without one."""
  window, n_layer = arch.get("window"), arch["n_layer"]
  if window is None:
    return arch, ""
  pattern = arch.get("window_pattern", "local")
  kinds = pattern.split(",")
  if "local" not in layer_kinds(pattern, n_layer):
    note = (f"the checkpoint's window ({window}) applied to none of its {n_layer} layers (window_pattern "
            f"{pattern!r}): the model trained without a window, and is read as one")
    return {k: v for k, v in arch.items() if k not in ("window", "window_pattern")}, note
  if len(kinds) > n_layer:
    ran = ",".join(kinds[:n_layer])
    note = (f"the checkpoint's window_pattern {pattern!r} has {len(kinds)} entries for its {n_layer} layers; "
            f"the layers used the first {n_layer}, so it is read as {ran!r}")
    return arch | {"window_pattern": ran}, note
  return arch, ""


def architecture(meta: dict) -> tuple[dict, str]:
  """The GPTConfig fields of the model a checkpoint's `meta` records, as it ran: fields it lacks as their absence
  meant (ABSENT_MODEL), its window as the layers read it (as_trained); and as_trained's note."""
  return as_trained(ABSENT_MODEL | dict(meta["model"]))


# The trainer's flags that set an architecture field, named where a resume finds it changed.
MODEL_FLAGS = {"n_layer": "--n-layer", "n_head": "--n-head", "n_kv_head": "--kv-heads", "d_model": "--d-model",
               "seq_len": "--seq-len", "vocab_size": "--vocab-size", "window": "--window",
               "window_pattern": "--window-pattern", "bias": "--bias / --no-bias"}


META_FLAGS = {"seed": "--seed", "data": "--data", "pack": "--pack / --no-pack", "model": "the model's flags",
              "run": "the run's flags"}  # what sets each top-level entry of a checkpoint's meta


def _same_path(a, b) -> bool:
  """--data as a checkpoint from before data.source recorded it (as typed, maybe relative to where that run
  started) and as this run resolves it: the same where the typed path resolves here to this run's."""
  return (isinstance(a, str) and isinstance(b, str) and data.DEFAULT_NAME not in (a, b)
          and data.source(a) == b)


def _other_path(saved: dict, expected: dict) -> bool:
  """The checkpoint trained on data at another path than this run's (check_meta then names the path; the content
  of this run's data says nothing of the checkpoint's)."""
  a, b = saved.get("data"), expected.get("data")
  return a != b and not _same_path(a, b)


def check_meta(directory: str, step: int, saved: dict, expected: dict, allow_change=()) -> dict:
  """Refuses a resume that would not continue the saved run; returns the changes `allow_change` accepts.

  Architecture (with the attention window), seed, data (its resolved path, and its content as Dataset.content
  records it, where the checkpoint did; unless `allow_change` names "data") and packing must match; the trajectory
  settings under "run" (learning rate, schedule length, batch, dtype, ...) may differ only
  where `allow_change` names them.
  Returns {setting: {"from": checkpoint's value, "to": this run's}} for the accepted differences.
  """
  diffs, accepted = [], {}
  for key in ("model", "seed", "data", "data_content", "pack", "run"):
    a, b = saved.get(key, ABSENT_META.get(key)), expected.get(key)
    if key == "data" and _same_path(a, b) or key == "data_content" and a is None:  # None: saved before it was kept
      continue
    if key in ("data", "data_content") and "data" in allow_change:
      if a != b:
        accepted[key] = {"from": a, "to": b}
      continue
    if key == "model" and isinstance(a, dict) and "n_layer" in a:
      a = as_trained(a)[0]  # a window pattern GPTConfig now refuses, as the model ran
    if isinstance(a, dict) and isinstance(b, dict) and key != "data_content":
      for k in sorted(set(a) | set(b)):
        was = a.get(k, ABSENT_FIELDS.get(key, {}).get(k))
        if was == b.get(k):
          continue
        if key == "run" and k in allow_change:
          accepted[k] = {"from": was, "to": b.get(k)}
        else:
          hint = (f" (accept with --allow-change {k})" if key == "run" else
                  f" (python -m train sets it with {MODEL_FLAGS[k]})" if key == "model" and k in MODEL_FLAGS else "")
          diffs.append(f"{key}.{k}: checkpoint {was!r}, now {b.get(k)!r}{hint}")
    elif key == "data_content" and a != b:
      if _other_path(saved, expected):  # the path, named above: this run's content says nothing of that data
        continue
      diffs.append(f"data: {expected.get('data')!r} held other data when the checkpoint was saved: {a} then, {b} "
                   "now (token counts for training and held out, and a sha256 of each file's size and ends; "
                   "accept with --allow-change data)")
    elif a != b:
      hint = "; or accept it with --allow-change data" if key == "data" else ""
      diffs.append(f"{key}: checkpoint {a!r}, now {b!r} (python -m train sets it with {META_FLAGS[key]}{hint})")
  if diffs:
    raise ResumeMismatchError(
        f"cannot resume from {directory} (step {step}): it was written by a different run:\n  " + "\n  ".join(diffs)
        + "\nRun with the checkpoint's settings, or give a new --ckpt-dir to start afresh.")
  return accepted
