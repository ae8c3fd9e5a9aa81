"""Process 0 decides, every process acts on its answer: the broadcast the trainer's folder handling uses.

Each process calls `from_process_0` with its own value at the same point; process 0's comes back on
all of them. Process 0 must reach that point on every path, its failures included: the others wait
for its answer and would wait for ever for one that never comes.
"""

from __future__ import annotations

import json
from typing import Callable, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

T = TypeVar("T")


def from_process_0(text: str) -> str:
  """Process 0's `text` on every process, whatever its length (two broadcasts: its size in bytes, then its UTF-8
  bytes); the others' own are not read."""
  if jax.process_count() == 1:
    return text
  data = text.encode() if jax.process_index() == 0 else b""
  size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int32)))[0])
  raw = np.frombuffer(data.ljust(max(size, 1), b"\0"), np.uint8)  # (max(size, 1),) on every process
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(raw)))[:size].decode()


def any_signal(local: int | None) -> int | None:
  """The stop signal some process received (the lowest-numbered such process's), on every process; None where
  none did. Every process calls it at the same step: a signal reaches one process (a kill of one PID) or all
  (a scheduler's preemption), and every process must then stop and save at the same step, since a save is a
  collective the others would otherwise wait in for ever."""
  return next((x for x in every_process(local or 0) if x), None)


def every_process(value: int) -> list[int]:
  """Each process's `value` (an int32), in process order, on every process; every process calls it at the same
  point."""
  if jax.process_count() == 1:
    return [value]
  return [int(x) for x in np.asarray(multihost_utils.process_allgather(np.array([value], np.int32))).reshape(-1)]


def on_process_0(work: Callable[[], T], *, errors: tuple[type[Exception], ...] = (),
                 default: type[Exception] = RuntimeError) -> T:
  """work() on process 0, and its result (None or JSON: an int, a string) on every process. Where it raises,
  process 0 sends the error before raising it, and every other process raises the same message as the class of
  `errors` with its name, else as `default`: none waits for an answer that never comes."""
  if jax.process_count() == 1:
    return work()
  if jax.process_index() != 0:
    answer = json.loads(from_process_0(""))
    if "error" in answer:
      kind, message = answer["error"]
      raise {c.__name__: c for c in errors}.get(kind, default)(message)
    return answer["value"]
  try:
    value = work()
  except Exception as e:
    from_process_0(json.dumps({"error": [type(e).__name__, str(e)]}))
    raise
  from_process_0(json.dumps({"value": value}))
  return value
