"""The training loop: over every device on the run's mesh (train.mesh), checkpointed, resumable, measured.

`run` reads as its steps: open the checkpoint folder and the output files (path problems
surface here, before anything compiles), load data, build the model and optimizer, resume
from the newest intact checkpoint, train, summarise. SIGINT and SIGTERM end the step being
run, save it and raise signals.Stopped; a second one stops the run at once, unless it comes
while a checkpoint is written: that save finishes first (train.signals). One that comes before
the first step stops the run before it: loading the data (which writes nothing) is cut short,
nothing is built or compiled after it, and what the run made and left empty (its checkpoint
folder and lock file, its metrics file) is removed, as for a refused run.

Packed runs (TrainConfig.pack) train on rows of whole documents (train.packing); validation
is the same unpacked held-out windows in both modes (train.data says why). Neither mode pads,
so tokens_per_s counts only real tokens.

The settings are train.config's TrainConfig; the model, optimizer and jitted step it trains are
train.step's; the batches and the Session the steps read are train.session's; what a run says apart
from its steps (notices, the attention check, the summary and its sample) is train.report; whether
its outputs lie where --data reads is train.overlap's check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import time

import jax
import numpy as np
from tqdm.auto import tqdm

import models
from models import ops
from train import checkpoint, data, hosts, metrics, overlap, report, signals, stepdirs, tokenizers, undo
from train import mesh as mesh_lib
from train.config import PROFILE_WINDOW, TrainConfig
from train.session import Batches, Session
from train.step import build, lr


class TrainingDiverged(RuntimeError):
  pass


def _open_outputs(cfg: TrainConfig, stack: contextlib.ExitStack) -> tuple[checkpoint.Checkpoints | None,
                                                                          metrics.MetricsFile]:
  """Locks the checkpoint folder and opens the metrics file: every path problem, before any work. A run refused or
  stopped after this removes what these made and it left empty (_undo_if_raised)."""
  if cfg.profile_dir and os.path.exists(cfg.profile_dir) and not os.path.isdir(cfg.profile_dir):
    raise ValueError(f"--profile-dir {cfg.profile_dir}: is a file; give a folder for the trace")
  if cfg.profile_dir:
    try:  # the trace is written after steps have run: make sure it can be
      made = undo.make_dirs(cfg.profile_dir)
      _undo_if_raised(stack, lambda: undo.remove_empty(made))
      tempfile.TemporaryFile(dir=cfg.profile_dir, prefix=".attnlayers-probe-").close()
    except OSError as e:
      raise ValueError(f"--profile-dir {cfg.profile_dir}: cannot write there ({e.strerror})") from None
  ckpts = checkpoint.Checkpoints(cfg.ckpt_dir) if cfg.ckpt_dir else None
  if ckpts:
    stack.callback(ckpts.close)
    _undo_if_raised(stack, ckpts.discard_if_unused)
    ours = ckpts.listing().ours
    if cfg.profile_dir and ours and cfg.steps - ours[-1] < PROFILE_WINDOW[1]:
      raise ValueError(f"--profile-dir traces steps {PROFILE_WINDOW[0]}-{PROFILE_WINDOW[1]} after the resume "
                       f"from step {ours[-1]}, but --steps is {cfg.steps}")
  out = metrics.MetricsFile(cfg.metrics)
  stack.callback(out.close)
  _undo_if_raised(stack, out.discard_if_empty)
  return ckpts, out


def _undo_if_raised(stack: contextlib.ExitStack, undo_it) -> None:
  """Calls `undo_it` as `stack` closes on an exception (a run refused, failed or stopped by a signal: whatever it
  made that holds nothing of the run's is removed; each undo removes only what is still empty, or unsaved, so a
  stopped run's checkpoints and records stay); the exception goes on. `undo_it` returns the paths it removed,
  which a signal's stop names (signals.Stopped.report)."""
  def exit_(kind, value, _) -> bool:
    if kind is not None:
      removed = undo_it()
      if isinstance(value, signals.Stopped):
        value.removed += removed
    return False  # never swallows the exception
  stack.push(exit_)


def _load_data(cfg: TrainConfig, walk: data.Walk) -> data.Dataset:
  dataset = data.load(cfg.data, cfg.model.seq_len, pack=cfg.pack, walk=walk, vocab_size=cfg.model.vocab_size,
                      raw_bytes=cfg.data_raw_bytes, progress=cfg.progress and jax.process_index() == 0)
  if dataset.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"data {dataset.name} has token ids up to {dataset.vocab_size - 1}, more than the model's "
                     f"vocab_size {cfg.model.vocab_size}; use --vocab-size {dataset.vocab_size} or larger")
  report.vocab_notice(cfg, dataset)
  return dataset


def _resume_point(cfg: TrainConfig, ckpts, meta: dict) -> tuple[int, dict]:
  """The newest checkpoint that verifies and belongs to this run (0: a fresh run), and the changes to the run's
  settings that --allow-change accepts (checkpoint.check_meta); refuses another run's."""
  step = ckpts.newest_intact() if ckpts else None
  if ckpts:  # fresh or resumed: a folder that is not ours where this run would save stops it now, not at the save
    saves = [s for s in range((step or 0) + 1, cfg.steps + 1) if s % cfg.ckpt_every == 0 or s == cfg.steps]
    foreign = set(ckpts.listing().foreign)
    at = lambda s: (stepdirs.step_path(ckpts.directory, s), stepdirs.saving_path(ckpts.directory, s))
    paths = [p for s in saves for p in at(s) if os.path.lexists(p) and (p.endswith(stepdirs.SAVING) or s in foreign)]
    if paths:
      raise checkpoint.CheckpointError(
          f"{ckpts.directory} holds files or folders where this run would save steps, without {stepdirs.MANIFEST}: "
          f"{', '.join(paths)}. Move them, or give another --ckpt-dir (a <step>.saving folder without "
          f"{stepdirs.JOURNAL} may be a save that an older attnlayers left when it was stopped: delete it if it "
          "is one)")
  if step is None:
    return 0, {}
  if step > cfg.steps:  # before the settings' check, which would offer --allow-change steps for these --steps
    raise checkpoint.ResumeMismatchError(
        f"{ckpts.directory} holds step {step}, past --steps {cfg.steps}: there is nothing to train. "
        f"{_steps_on(step, ckpts.meta(step).get('run', {}).get('steps'))} to train on from it, or sample from it"
        f"{_sample_needs(cfg)}: python -m sample --ckpt-dir {ckpts.directory}")
  return step, ckpts.check_resume(step, meta, cfg.allow_change)


def _sample_needs(cfg: TrainConfig) -> str:
  """' (needs ...)' where python -m sample cannot take the tokens of cfg's data here (tokenizers.missing), else ''."""
  needs = tokenizers.missing(data.tokenizer(data.source(cfg.data)))
  return f" ({needs})" if needs else ""


def _steps_on(step: int, planned) -> str:
  """The --steps that train on from a checkpoint at `step` whose run had --steps `planned` (None: not recorded):
  its own, unchanged, where it stopped before them; any other above `step` with --allow-change steps."""
  if isinstance(planned, int) and planned > step:
    return f"Give --steps {planned} (its run's own) or other --steps above {step} with --allow-change steps"
  had = f" (its run had --steps {planned})" if isinstance(planned, int) else ""
  return f"Give --steps above {step} with --allow-change steps{had}"


def _finite(s: Session, loss: float, step: int) -> float:
  """`loss`, where it is finite; else TrainingDiverged, after writing the run's `diverged` record: the step, its
  loss, and the step of the last good checkpoint (None: none), which the run would resume from."""
  if not math.isfinite(loss):
    good = s.ckpts.last_good if s.ckpts else None
    where = f"the last good checkpoint, step {good} in {s.ckpts.directory}, is untouched" if good is not None \
        else "no checkpoint was written"
    s.out.write({"event": "diverged", "step": step, "loss": loss, "last_good": good})
    raise TrainingDiverged(f"loss is {loss} at step {step}; stopped: {where}. Lower --lr or raise --warmup.")
  return loss


def _validate(s: Session, state: dict) -> float:
  losses = [s.model.eval_loss(state["params"], state["fp8"], s.batches("val", i)) for i in range(s.cfg.eval_batches)]
  return float(np.mean([float(l) for l in losses]))


def _report(s: Session, step: int, loss_arr, state: dict, bar, *, evaluate: bool, save: bool,
            next_loss=None) -> float:
  """Writes step `step`'s metrics record (with the validation loss if `evaluate`), saves it if `save`;
  `state` is that step's unless neither (a log-only report may come one step late: _train). `next_loss`:
  the loss of the step dispatched after this one, where there is one."""
  was_ready = loss_arr.is_ready()  # before waiting on it: whether its end went unseen
  loss = _finite(s, float(loss_arr), step)  # waits for the step
  now = time.perf_counter()  # read before looking at the next step: if that one ends after it, it ran before it
  done = _steps_done(step, was_ready, next_loss)
  counted = done is not None and done > s.throughput.last_step  # steps ended in the interval, and it can end now
  rate = s.throughput.interval(done if counted else s.throughput.last_step, now)
  record = {"step": step, "loss": loss, "lr": lr(s.model, step)} | rate
  if evaluate:
    record["val_loss"] = s.val_loss[step] = _validate(s, state)
    if jax.process_index() == 0:
      tqdm.write(f"step {step}: loss {loss:.4f}, val_loss {record['val_loss']:.4f}")
  if save:
    with s.stop.saving():  # a second signal now waits for the save (signals.StopRequests.saving)
      s.ckpts.save(step, state, s.meta)
  s.out.write(record)
  postfix = {"loss": f"{loss:.3f}"} | ({"tok_s": f"{record['tokens_per_s']:,.0f}"} if record.get("tokens_per_s") else {})
  bar.set_postfix(postfix | ({"val": f"{record['val_loss']:.3f}"} if "val_loss" in record else {}))
  if evaluate or save:  # the next interval starts after them: their time is not the steps'
    s.throughput.mark(done)
  elif counted:  # it starts where this one was measured: writing the record is the next step's time, as it runs
    s.throughput.mark(done, at=now)
  return loss  # (nothing counted: the interval goes on, so the time spent here is not dropped from the rate)


def _steps_done(step: int, was_ready: bool, next_loss) -> int | None:
  """How many steps are done now, at a moment that can end a rate's interval, or None where it cannot; just
  after waiting on step `step`'s loss, with `next_loss` that of the step dispatched after it (None: none yet).

  Nothing in flight (no next step, or it is done too: a device that ran it as it was dispatched) gives the
  exact count. A next step still running began as `step` ended where that end was waited for (`was_ready`
  False): the device had it queued. Otherwise `step` ended unseen, the device may have begun the next step
  any time since, and the interval goes on to a later report."""
  if next_loss is None:
    return step
  if next_loss.is_ready():
    return step + 1
  return None if was_ready else step


class _Profiler:
  """A trace of the run's steps PROFILE_WINDOW into profile_dir; stopped on the way out, whatever happens."""

  def __init__(self, directory: str | None, start: int):
    self.directory = directory  # None: no trace
    self.first, self.last = start + PROFILE_WINDOW[0], start + PROFILE_WINDOW[1]  # absolute step numbers
    self.on = False  # tracing now

  def before(self, step: int, previous) -> None:
    """Starts the trace before step `step` once `previous` (the step before's loss, or None) is done, so that
    no earlier step's kernels fall in the window."""
    if self.directory and step == self.first:
      if previous is not None:
        jax.block_until_ready(previous)
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.on = True

  def after(self, step: int, loss_arr) -> None:
    if self.on and step == self.last:
      jax.block_until_ready(loss_arr)
      self.close()

  def close(self) -> None:
    if self.on:
      jax.profiler.stop_trace()
      self.on = False


def _due(cfg: TrainConfig, step: int, every: int) -> bool:
  """Whether something done every `every` steps (0: never) is done at `step`; the last step always."""
  return bool(every) and (step % every == 0 or step == cfg.steps)


def _train(s: Session, state: dict) -> tuple[dict, float | None]:
  """Steps start+1 .. steps; returns (state, last loss). Raises signals.Stopped after saving on a signal.

  A step whose report only logs (no evaluation, no save, not the last step) is reported once the next
  step has been dispatched: reading its loss then waits for it while the GPU already has the next step
  queued, so the device never idles on the host's report. Evaluation and saves read the step's own state,
  which the next step's donation frees, so they are reported at once. Reported one step late, a
  non-finite loss stops the run one step later, before anything after it is saved."""
  cfg, loss, pending = s.cfg, None, None  # pending: (step, loss) of a log-only report not yet written
  loss_arr = None  # the last dispatched step's loss
  if _stop_agreed(s.stop):  # arrived while setting up: nothing new to save
    raise _stopped(s, s.start, saved=False)
  bar = tqdm(total=cfg.steps, initial=s.start, disable=not cfg.progress or jax.process_index() != 0, unit="step")
  profiler = _Profiler(cfg.profile_dir, s.start)
  try:
    batch = s.batches("train", s.start + 1)
    for step in range(s.start + 1, cfg.steps + 1):
      profiler.before(step, loss_arr)
      state, loss_arr = s.model.train_step(state, batch, step)
      if pending:  # the previous step's log record, written while this step runs
        (done, done_loss), pending = pending, None
        loss = _report(s, done, done_loss, state, bar, evaluate=False, save=False, next_loss=loss_arr)
      if step < cfg.steps:
        batch = s.batches("train", step + 1)  # the next batch is made while this step runs
      profiler.after(step, loss_arr)
      bar.update(1)
      if s.throughput.time_to_first_step_s is None:
        loss = _finite(s, float(loss_arr), step)
        s.throughput.first_step_done(step)
      log, evaluate = _due(cfg, step, cfg.log_every), _due(cfg, step, cfg.eval_every)
      # read once: a signal during the report waits for the next step; several processes act on it together
      stopping = _stop_agreed(s.stop) if jax.process_count() == 1 or log or _due(cfg, step, cfg.ckpt_every) else False
      save = s.ckpts is not None and (_due(cfg, step, cfg.ckpt_every) or stopping)
      if evaluate or save or stopping or (log and step == cfg.steps):
        loss = _report(s, step, loss_arr, state, bar, evaluate=evaluate, save=save)
      elif log:
        pending = (step, loss_arr)
      if stopping or s.stop.held is not None:  # held: it came during this step's save, which finished
        raise _stopped(s, step, saved=save)
    if _stop_agreed(s.stop):  # it came during the last step's report, which saved that step
      raise _stopped(s, cfg.steps, saved=s.ckpts is not None)
  except Exception:
    if pending and pending[1].is_ready():  # the next step failed to start: the finished step's record is kept
      with contextlib.suppress(Exception):
        _report(s, *pending, state, bar, evaluate=False, save=False)
    raise
  finally:
    profiler.close()
    bar.close()
  return state, loss


def _stop_agreed(stop: signals.StopRequests) -> bool:
  """Whether the run stops here: a signal was received, on any process of a multi-host run (all of them call this
  at the same points: after loading the data, before the first step, and at the log and checkpoint steps, so a
  signal to one process stops every process within log_every steps, each saving the same step;
  train.hosts.any_signal)."""
  agreed = hosts.any_signal(stop.received)
  if agreed is not None:
    stop.adopt(agreed)
  return agreed is not None


def _by(stop: signals.StopRequests) -> str:
  return f"{stop.name}{' (received by another process)' if stop.elsewhere else ''}"


def _stopped_before_training(stop: signals.StopRequests, loading: str) -> signals.Stopped:
  """The exception that ends a run stopped by a signal that came `loading` ("before", "while": it was cut short
  there, or "after") the data loaded. Nothing was built, compiled or saved, and no record written."""
  when = {"before": "before the data loaded (none of it was read)", "after": "after the data loaded",
          "while": "while the data loaded (the loading stopped there)"}[loading]
  return signals.Stopped(stop.ending, None, f"stopped by {_by(stop)} {when}, before any step: nothing was built "
                         "or compiled, nothing to save")


def _stopped(s: Session, step: int, saved: bool) -> signals.Stopped:
  """The exception that ends a run stopped by a signal after `step`; writes its `stopped` record."""
  if saved:
    where = f"saved step {step} in {s.ckpts.directory}; the same command with --ckpt-dir {s.ckpts.directory} " \
            "resumes from there"
  elif s.ckpts and s.start:
    where = f"nothing new to save; the same command with --ckpt-dir {s.ckpts.directory} resumes from step {s.start}"
  elif s.ckpts:  # the folder is removed on the way out where this run made it (_undo_if_raised, train.cli)
    where = "nothing was trained, nothing to save"
  else:
    where = "nothing saved (no --ckpt-dir)"
  s.out.write({"event": "stopped", "step": step, "signal": s.stop.name, "saved": saved})
  return signals.Stopped(s.stop.ending, step, f"stopped by {_by(s.stop)} after step {step}: {where}")


def data_mesh(devices) -> jax.sharding.Mesh:
  """The mesh of `devices` all on the data axis (train.mesh.make; the run's default mesh)."""
  return mesh_lib.make(mesh_lib.parse(None, len(devices)), devices)


def run(cfg: TrainConfig, walk: data.Walk | None = None) -> dict:
  """Trains; returns the summary. Raises TrainingDiverged on a non-finite loss, signals.Stopped on a signal.
  walk: the data.Walk of cfg.data that its caller checked the flags with (train.cli), which the check of cfg's
  outputs here and load then read too; None: one of its own."""
  t_start = time.perf_counter()
  walk = data.Walk(cfg.data) if walk is None else walk
  # train.checks refused these on its flags; a cfg made elsewhere (or given its run folder since) is checked here
  outside = overlap.outputs_read_as_data(cfg.data, walk, ckpt_dir=cfg.ckpt_dir, metrics=cfg.metrics,
                                         profile_dir=cfg.profile_dir)
  if outside:
    raise ValueError("; ".join(outside))
  with contextlib.ExitStack() as stack:
    stop = stack.enter_context(signals.StopRequests())
    data.check_source(cfg.data)  # a missing --data path stops the run before any folder is locked or written
    # so does a backend that cannot run the model's attention (e.g. its segment ids); the summary reports these plans
    attention = report.check_attention(cfg)
    ops.resolve(cfg.model.kernels)  # and kernels="pallas" off a CUDA GPU
    report.notices(cfg)
    ckpts, out = _open_outputs(cfg, stack)
    # loading only reads: a signal cuts it short (one process: several must each reach the agreement below,
    # and a refusal of the data that the others meet would leave one cut short waiting there)
    one = jax.process_count() == 1
    early = one and stop.received is not None  # came while setting up: interruptible then loads nothing
    dataset = stop.interruptible(lambda: _load_data(cfg, walk)) if one else _load_data(cfg, walk)
    if _stop_agreed(stop):  # nothing built or compiled yet, nor written: stop before any of it
      raise _stopped_before_training(stop, "before" if early else "after" if dataset is not None else "while")
    if cfg.pack:  # the kernels' bound on documents per row (te runs B * max_segments sequences): this data's
      cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_segments=dataset.packed.max_segments()))
      attention = report.check_attention(cfg)  # the plans of the calls with this data's max_segments
    sizes = mesh_lib.parse(cfg.mesh, jax.device_count())  # train.checks checked --mesh; a cfg made elsewhere here
    if (unfit := mesh_lib.check(sizes, jax.device_count(), cfg.model, cfg.batch_size)) is not None:
      raise ValueError(unfit)
    mesh = mesh_lib.make(sizes)
    for line in mesh_lib.notices(sizes, cfg.model) if jax.process_index() == 0 else ():
      print(line, flush=True)
    meta = {"model": cfg.model.architecture(), "seed": cfg.seed, "data": data.source(cfg.data),
            "data_content": dataset.content(), "pack": cfg.pack, "run": cfg.trajectory()}
    start, changes = _resume_point(cfg, ckpts, meta)
    model, state = build(cfg, mesh)
    if start:
      state = ckpts.restore(start, state)
      newest = ", the newest checkpoint that verifies" if ckpts.set_aside else ""
      print(f"resumed from {ckpts.directory} at step {start}{newest}", flush=True)
      for k, c in changes.items():  # said once the restore, which can still refuse, is done
        name = "data: content " if k == "data_content" else f"{k}: "  # data_content: --allow-change data
        print(f"--allow-change {name}{c['from']!r} in the checkpoint, {c['to']!r} from now on", flush=True)
    if ckpts and start < cfg.steps:  # a disk that cannot hold the next save stops the run before it trains
      ckpts.check_room(min(cfg.steps, (start // cfg.ckpt_every + 1) * cfg.ckpt_every), state)
    if start:
      out.write({"event": "resume", "step": start, "ckpt_dir": ckpts.directory, "changed": changes})
    # the first records, once nothing can refuse the run any more: a refused run writes none
    out.write({"event": "start", "from_step": start, "steps": cfg.steps, "batch_size": cfg.batch_size,
               "seq_len": cfg.model.seq_len, "attention": cfg.model.backend, "devices": jax.device_count(),
               "mesh": dict(mesh.shape),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})  # where a run (or a resume) begins in the file
    if start >= cfg.steps:
      print(f"step {start} of {cfg.steps} is done: nothing to train")
    throughput = metrics.Throughput(t_start, start, cfg.batch_size * cfg.model.seq_len,
                                    models.flops_per_token(cfg.model, model.n_params, cfg.model.seq_len),
                                    metrics.peak_flops(cfg.peak_tflops))
    s = Session(cfg, model, Batches(dataset, cfg, mesh_lib.batch_sharding(mesh)), ckpts, meta, out, throughput,
                stop, start, attention)
    state, loss = _train(s, state)
    summary = report.summary(s, state, loss, dataset)
    out.write(summary)
    if stop.received is not None:  # it came after the last step's report (which saved it): during the summary
      where = f"saved in {ckpts.directory}" if ckpts else "nothing saved (no --ckpt-dir)"
      raise signals.Stopped(stop.ending, cfg.steps, f"stopped by {stop.name} at the end of the run, after step "
                            f"{cfg.steps}: {where}")
  return summary
