"""SIGINT and SIGTERM ask the loop to stop; they do not stop it mid-step.

Preemption on shared clusters sends SIGTERM, Ctrl-C sends SIGINT. Either one is recorded
here; the loop finishes the step it is in, saves a checkpoint and raises `Stopped`, and the
CLI exits with the shell's code for that signal (128 + signum: 130, 143). A second signal
while the loop is stopping gets the signal's usual handling, for a user who cannot wait.
"""

from __future__ import annotations

import signal
import threading

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
  """The run stopped on a signal after finishing (and, with checkpoints, saving) `step`."""

  def __init__(self, signum: int, step: int, message: str):
    self.signum, self.step = signum, step
    super().__init__(message)

  @property
  def exit_code(self) -> int:
    return 128 + self.signum


class StopRequests:
  """Context manager: while inside, `received` is the first SIGINT/SIGTERM that arrived, or None.

  Handlers can only be installed from the main thread; elsewhere (a library caller's worker
  thread) signals keep their usual meaning, as do signals the process ignores (a shell starts
  background jobs with SIGINT ignored).
  """

  def __init__(self):
    self.received: int | None = None
    self._previous: dict[int, object] = {}

  def _handle(self, signum, frame):
    if self.received is not None:  # the second signal: stop now, the usual way
      self._restore()
      signal.raise_signal(signum)
      return
    self.received = signum

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

  @property
  def name(self) -> str | None:
    return signal.Signals(self.received).name if self.received is not None else None
