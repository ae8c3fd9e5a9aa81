"""SIGINT and SIGTERM ask the loop to stop; they do not stop it mid-step.

Preemption on shared clusters sends SIGTERM, Ctrl-C sends SIGINT. Either one is recorded
here; the loop finishes the step it is in, saves a checkpoint and raises `Stopped`, and the
CLI exits with the shell's code for that signal (128 + signum: 130, 143). A second signal
while the loop is stopping gets the signal's usual handling, for a user who cannot wait,
except while a checkpoint is being written (`StopRequests.saving`): interrupted, that save
would be lost, and with it every step since the last one. There the signal is held: the save
finishes and is sealed, then the loop stops and the CLI exits with that signal's code.

In a multi-host run the processes agree (train.hosts.any_signal, at each logged or checkpoint
step): a signal to one process stops every process after the same step, each saving its part of
that step's checkpoint; the others `adopt` the signal and say it came to another process.

Work that writes nothing (loading the data) need not finish: inside `interruptible` the first signal
ends it where it is, and the run stops before anything is built or compiled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
  """The run stopped on a signal after finishing (and, with checkpoints, saving) `step`; None: before its first
  step. `removed`: what the run had made and removed again on the way out, holding nothing (train.undo)."""

  def __init__(self, signum: int, step: int | None, message: str):
    self.signum, self.step = signum, step
    self.removed: list[str] = []
    super().__init__(message)

  @property
  def exit_code(self) -> int:
    return 128 + self.signum

  def report(self) -> str:
    """The message, and a line naming what was removed, if anything."""
    removed = f"\nremoved what this run had made and not used: {', '.join(self.removed)}" if self.removed else ""
    return f"{self}{removed}"


class Interrupted(BaseException):
  """Raised by the handler inside StopRequests.interruptible; a BaseException, as KeyboardInterrupt, so that no
  `except Exception` in the work swallows it."""


class StopRequests:
  """Context manager: while inside, `received` is the first SIGINT/SIGTERM that arrived, or None.

  Handlers can only be installed from the main thread; elsewhere (a library caller's worker
  thread) signals keep their usual meaning, as do signals the process ignores (a shell starts
  background jobs with SIGINT ignored).
  """

  def __init__(self):
    self.received: int | None = None
    self.held: int | None = None  # the last signal after the first that came while a save was written, if any
    self._saving = False  # inside saving()
    self._interrupting = False  # inside interruptible(): the first signal raises Interrupted there
    self.elsewhere = False  # received came from another process of a multi-host run (adopt)
    self._previous: dict[int, object] = {}

  def _handle(self, signum, frame):
    if self.received is None:
      self.received = signum
      if self._interrupting:
        raise Interrupted
    elif self._saving:  # a later signal during a save: it would lose the save, so the save finishes first
      self.held = signum
      # os.write, not print: the handler may run inside a print to stderr, which would then raise; and nothing
      # raised here may reach the save (a closed stderr)
      with contextlib.suppress(OSError):
        os.write(2, f"\n{signal.Signals(signum).name} while a checkpoint is being written: the save finishes, "
                    "then the run stops\n".encode())
    else:  # the second signal: stop now, the usual way
      self._restore()
      signal.raise_signal(signum)

  @contextlib.contextmanager
  def saving(self):
    """While inside, a signal after the first interrupts nothing: it is recorded in `held`, and the caller,
    once the save is done, stops with it (`ending`)."""
    self._saving = True
    try:
      yield
    finally:
      self._saving = False

  def interruptible(self, work):
    """work(), or None where a signal arrived before or during it: the first signal raises in it, wherever it is
    (between Python bytecodes: a C call in progress, e.g. one file's read, finishes first). Only for work that
    writes nothing, which may then stop anywhere. A second signal gets its usual handling, as outside."""
    try:
      self._interrupting = True
      try:
        if self.received is not None:
          return None
        return work()
      finally:
        self._interrupting = False
    except Interrupted:  # here, not inside: it may come as late as the line that clears _interrupting
      return None

  def _restore(self) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def __enter__(self) -> "StopRequests":
    if threading.current_thread() is threading.main_thread():
      ignored = [s for s in HANDLED if signal.getsignal(s) == signal.SIG_IGN]
      self._previous = {s: signal.signal(s, self._handle) for s in HANDLED if s not in ignored}
    return self

  def __exit__(self, *exc) -> None:
    self._restore()

  def adopt(self, signum: int) -> None:
    """Stops this process as if `signum` had arrived here: another process received it (train.hosts.any_signal)."""
    if self.received is None:
      self.received, self.elsewhere = signum, True

  @property
  def ending(self) -> int | None:
    """The signal that ends the run: one held during a save, else the first, else None."""
    return self.held if self.held is not None else self.received

  @property
  def name(self) -> str | None:
    return signal.Signals(self.ending).name if self.ending is not None else None
