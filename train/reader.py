"""Reading a checkpoint folder: the one reader that the trainer's resume (train.checkpoint) and python -m sample use.

Reading writes nothing in the folder: orbax writes nothing when it restores, and the reader takes no lock, renames
nothing and cleans nothing up, so python -m sample reads a folder a trainer may be saving to at the same time. A
step is read whole (the trainer's resume) or only its parameters (python -m sample). Errors are CheckpointError
and one line: orbax's and tensorstore's run to hundreds.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from train import stepdirs


class CheckpointError(RuntimeError):
  """A checkpoint folder this run cannot use or write; the message says what to do."""


def say(message: str) -> None:
  """Prints `message` to stderr on process 0 only (every process reads the same checkpoint)."""
  if jax.process_index() == 0:
    print(message, file=sys.stderr, flush=True)


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """The orbax handler of each item of a step, by how it is read: `state` whole (StandardRestore) or only some of
  its entries (PyTreeRestore with partial_restore), `meta` as JSON, `fp8` whole."""
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for item, args, handler in (("state", ocp.args.StandardRestore, ocp.StandardCheckpointHandler),
                              ("state", ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler),
                              ("meta", ocp.args.JsonRestore, ocp.JsonCheckpointHandler),
                              ("fp8", ocp.args.StandardRestore, ocp.StandardCheckpointHandler)):
    registry.add(item, args, handler)
  return registry


class Reader:
  """Reads the steps of the checkpoint folder `directory`. Messages call the folder `named`: as the user gave it
  (default "--ckpt-dir <directory>"; python -m sample names the run runs/latest names so)."""

  def __init__(self, directory: str, named: str | None = None):
    self.directory = directory
    self.named = f"--ckpt-dir {directory}" if named is None else named
    self.checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(handler_registry=_registry()))

  def path(self, step: int) -> str:
    """Step `step`'s folder, absolute (orbax takes absolute paths only)."""
    return os.path.abspath(stepdirs.step_path(self.directory, step))

  def items(self, step: int, **items) -> dict:
    """The items of step `step` that `items` names, each read with its orbax restore args."""
    path = self.path(step)
    return one_line(f"restore {', '.join(items)} from {path}",
                    lambda: self.checkpointer.restore(path, args=ocp.args.Composite(**items)))

  def meta(self, step: int) -> dict:
    """What step `step` recorded about its run: architecture, seed, data, packing, the run's settings."""
    return self.items(step, meta=ocp.args.JsonRestore())["meta"]

  def saved(self, step: int, item: str) -> dict:
    """The shapes and dtypes of the arrays of item `item` ("state" or "fp8") of step `step`, by their key path."""
    path = self.path(step)
    what = {"state": "array", "fp8": "FP8"}[item]
    tree = one_line(f"read the {what} metadata in {path}",
                    lambda: self.checkpointer.metadata(path).item_metadata[item].tree)
    return ocp.tree.to_flat_dict(tree)

  def state(self, step: int, like: dict) -> dict:
    """The state saved at `step` (params and optimizer state) in `like`'s structure, shapes and shardings."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return dict(self.items(step, state=ocp.args.StandardRestore(abstract))["state"])

  def params(self, step: int, like) -> dict:
    """Only the parameters saved at `step`, not the optimizer state beside them; `like` is their abstract tree."""
    item = {"params": like}
    return self.items(step, state=ocp.args.PyTreeRestore(
        item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))["state"]["params"]

  def has_fp8(self, step: int) -> bool:
    """Step `step` holds FP8 scaling state (a te-fp8 run wrote it)."""
    return os.path.isdir(os.path.join(self.path(step), "fp8"))

  def fp8(self, step: int, like):
    """The saved FP8 scaling state in `like`'s structure. Arrays `like` has and the checkpoint lacks, or holds in
    another shape (it was written by an earlier attnlayers, whose te-fp8 kept less state), start afresh (`like`'s
    values) and a line says which; the rest is restored exactly."""
    saved = self.saved(step, "fp8")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    keys = [_names(p) for p, _ in leaves]
    fits = {k for k, (_, x) in zip(keys, leaves)
            if k in saved and tuple(saved[k].shape) == tuple(x.shape) and np.dtype(saved[k].dtype) == np.dtype(x.dtype)}
    if fits == set(keys) == set(saved):
      target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
      return self.items(step, fp8=ocp.args.StandardRestore(target))["fp8"]
    sharding = leaves[0][1].sharding  # FP8 state is replicated
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding),
                          ocp.tree.from_flat_dict(saved))
    restored = ocp.tree.to_flat_dict(self.items(step, fp8=ocp.args.StandardRestore(target))["fp8"])
    fresh = [".".join(k) for k in keys if k not in fits]
    say(f"checkpoint step {step} holds no FP8 scaling state for {', '.join(fresh)} in this model's shapes (an "
        "earlier attnlayers wrote it): that state starts afresh, the rest is restored")
    return jax.tree_util.tree_unflatten(treedef, [restored[k] if k in fits else x for k, (_, x) in zip(keys, leaves)])

  def newest_intact(self) -> int:
    """The newest step that verifies against its manifest. Damaged steps, and newer step folders that are not
    sealed checkpoints, are only reported (setting them aside is the trainer's call)."""
    directory = self.directory
    if not os.path.isdir(directory):
      what = "is not a folder" if os.path.exists(directory) else "does not exist"
      raise CheckpointError(f"{self.named} {what}: give --ckpt-dir the folder python -m train saved to")
    found = stepdirs.listing(directory)
    if not found.ours and not found.foreign + found.empty:
      _refuse_a_folder_beside_a_run(directory, self.named)
    if not found.ours:
      unsealed = found.foreign + found.empty
      what = (f"its step folder{'s' if len(unsealed) > 1 else ''} {', '.join(map(str, sorted(unsealed)[:5]))} "
              f"{'have' if len(unsealed) > 1 else 'has'} no {stepdirs.MANIFEST}, the manifest python -m train seals "
              "each saved step with" if unsealed else "no step folder is in it")
      raise CheckpointError(f"{self.named} holds no checkpoint python -m train saved ({what}): give --ckpt-dir the "
                            "folder python -m train saved to")
    problems = []
    for step in reversed(found.ours):
      problem = stepdirs.problem(stepdirs.step_path(directory, step))
      if problem is None:
        for p in problems:
          print(f"skipped a damaged checkpoint: {p}", file=sys.stderr)
        for kind, steps in (("has no " + stepdirs.MANIFEST + ", so it is not a checkpoint python -m train sealed",
                             found.foreign), ("is empty", found.empty)):
          for newer in (n for n in steps if n > step):
            print(f"skipped {stepdirs.step_path(directory, newer)}: it {kind}", file=sys.stderr)
        return step
      problems.append(f"step {step}: {problem}")
    raise CheckpointError(f"no checkpoint in {directory} is intact: " + "; ".join(problems))

  def close(self) -> None:
    self.checkpointer.close()

  def __enter__(self) -> Reader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _names(path) -> tuple[str, ...]:
  """A jax key path as the names orbax files its arrays under: ('blocks', '0', 'attn', 'fp8_core', 'value')."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def one_line(what: str, call):
  """`call()`, where an error of orbax or tensorstore becomes a CheckpointError saying `what` failed, in one line."""
  try:
    return call()
  except Exception as e:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    raise CheckpointError(f"cannot {what}: {type(e).__name__}: {first}") from None


def _refuse_a_folder_beside_a_run(directory: str, named: str) -> None:
  """CheckpointError naming the run folder where `directory`, holding no step, is a step folder of a run or lies in
  one, or holds run folders (runs/): the folder to give instead."""
  step = stepdirs.step_folder_at(directory)
  if step is not None:
    run = os.path.dirname(step)
    where = "is" if os.path.realpath(directory) == step else "lies in"
    raise CheckpointError(f"{named} {where} the step folder {step} of the run in {run}, not a run's folder: give "
                          f"--ckpt-dir {run} (its newest intact step is read)")
  def a_run(name: str) -> bool:
    try:
      return os.path.isdir(os.path.join(directory, name)) and stepdirs.holds_run(os.path.join(directory, name))
    except OSError:  # a folder this user cannot list is not offered
      return False
  runs = sorted(n for n in os.listdir(directory) if a_run(n))
  if runs:
    raise CheckpointError(f"{named} holds no checkpoint of its own but the run folders {', '.join(runs[:3])}"
                          f"{', ...' if len(runs) > 3 else ''}: give --ckpt-dir one of them, e.g. --ckpt-dir "
                          f"{os.path.join(directory, runs[-1])}")
