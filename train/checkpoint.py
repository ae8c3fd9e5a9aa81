"""Checkpoints with orbax: model + optimizer state + step + data position, resumable.

Each checkpoint holds `state` (params and optimizer state), `meta` (step, the model's
architecture fields, seed and data source) and, for te-fp8 runs, `fp8` (FP8 scaling state).
A run may switch attention backend on resume: FP8 state is then dropped, or starts afresh. The batch of step s depends only on (seed, s),
so the step is the data position. Saves are synchronous, so a checkpoint that exists is
complete: a run killed mid-save resumes from the one before.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class ResumeMismatchError(ValueError):
  pass


class Checkpoints:
  def __init__(self, directory: str, *, keep: int = 3):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=("state", "meta", "fp8"),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: dict, meta: dict) -> None:
    items = dict(state=ocp.args.StandardSave({k: v for k, v in state.items() if k != "fp8"}),
                 meta=ocp.args.JsonSave(meta | {"step": step}))
    if state.get("fp8"):
      items["fp8"] = ocp.args.StandardSave(state["fp8"])
    self.manager.save(step, args=ocp.args.Composite(**items))

  def restore(self, step: int, like, expected_meta: dict):
    """(state, meta) of `step`; `like` gives the structure, shapes and shardings to restore into."""
    meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    check_meta(self.directory, step, meta, expected_meta)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {k: v for k, v in like.items() if k != "fp8"})
    state = dict(self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"])
    if "fp8" in like:
      state["fp8"] = like["fp8"]
      if like["fp8"] and os.path.isdir(os.path.join(self.directory, str(step), "fp8")):
        fp8 = jax.tree.map(ocp.utils.to_shape_dtype_struct, like["fp8"])
        state["fp8"] = self.manager.restore(step, args=ocp.args.Composite(fp8=ocp.args.StandardRestore(fp8)))["fp8"]
      elif like["fp8"]:
        print(f"checkpoint step {step} has no FP8 scaling state (another backend wrote it): FP8 scaling starts afresh")
    return state, meta

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def check_meta(directory: str, step: int, saved: dict, expected: dict) -> None:
  """The architecture, seed and data must match, or the resumed run would not continue this one."""
  diffs = []
  for key in ("model", "seed", "data"):
    a, b = saved.get(key), expected.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      diffs += [f"{key}.{k}: checkpoint {a.get(k)!r}, now {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    elif a != b:
      diffs.append(f"{key}: checkpoint {a!r}, now {b!r}")
  if diffs:
    raise ResumeMismatchError(
        f"cannot resume from {directory} (step {step}): it was written by a different run:\n  " + "\n  ".join(diffs)
        + "\nRun with the checkpoint's settings, or give a new --ckpt-dir to start afresh.")
