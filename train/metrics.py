"""Throughput, MFU and the metrics file.

MFU = flops_per_token * tokens_per_s / peak, with flops_per_token from
models.flops_per_token (6N + 12 L n_head head_dim T) and peak the device's dense bf16
datasheet rate (an NVIDIA GPU's tensor cores, a TPU's matrix units); null where the peak is
unknown (CPUs, unlisted devices) unless --peak-tflops. The run's summary records the peak used.
"""

from __future__ import annotations

import json
import math
import os
import re
import time

import jax

from train import undo

# Dense (no sparsity) bf16 datasheet peak, FLOP/s, by the model name in device_kind ("NVIDIA H100 80GB HBM3",
# "TPU v5 lite" for a TPU v5e), the first listed that matches as a whole word (peak_for). A plain substring read
# "NVIDIA L40" (181) as an L4 (121) and "NVIDIA A10G" as an A10, and gave the H100 PCIe (756) and the H100 and
# H200 NVL (835) the SXM boards' 989. Unlisted models (an A10G, an H800) have no peak (MFU null, no check), not
# another board's.
PEAK_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H200": 989e12, "GH200": 989e12,
             "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10": 125e12,
             "TPU v5 lite": 197e12}
PEAK_PLATFORMS = ("gpu", "tpu")  # where PEAK_BF16 is looked up; other devices (CPUs) have no peak


def peak_for(kind: str) -> float | None:
  """PEAK_BF16's entry for a device_kind, None where no model name in it is listed."""
  return next((v for k, v in PEAK_BF16.items()
               if re.search(rf"(?<![A-Za-z0-9]){re.escape(k)}(?![A-Za-z0-9])", kind)), None)


def peak_flops(override_tflops: float | None = None) -> float | None:
  if override_tflops:
    return override_tflops * 1e12
  device = jax.local_devices()[0]
  if device.platform not in PEAK_PLATFORMS:
    return None
  kind = getattr(device, "device_kind", "")
  return peak_for(kind)


def peak_fields(peak: float | None, override_tflops: float | None) -> dict:
  """The summary's record of what MFU divides by: mfu_peak_tflops, and mfu_peak, where it comes from (--peak-tflops,
  or the device's bf16 datasheet peak in PEAK_BF16); both None where MFU is null."""
  if not peak:
    return {"mfu_peak_tflops": None, "mfu_peak": None}
  kind = jax.local_devices()[0].device_kind
  return {"mfu_peak_tflops": peak / 1e12, "mfu_peak": "--peak-tflops" if override_tflops else
          f"the bf16 datasheet peak of {kind}"}


def peak_memory_bytes() -> int | None:
  stats = jax.local_devices()[0].memory_stats() if hasattr(jax.local_devices()[0], "memory_stats") else None
  return (stats or {}).get("peak_bytes_in_use")


class Throughput:
  """Steps/s over each interval between reported steps, and the run's typical rate.

  Intervals start after the first step (compilation stays out); the first one still runs while
  the device warms up (clocks ramp, caches fill), so the run's rate is the median of the intervals
  after it.
  """

  def __init__(self, t_start: float, start_step: int, tokens_per_step: int, flops_per_token: float,
               peak: float | None):
    self.t_start = t_start  # time.perf_counter() when the run began
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token
    self.peak = peak
    self.time_to_first_step_s: float | None = None  # from t_start to the first step's result
    self.rates: list[float] = []  # steps/s of each interval
    self.last_t, self.last_step = None, start_step
    self.reported = False  # whether interval() has run: the first report carries time_to_first_step_s

  def first_step_done(self, step: int) -> None:
    self.time_to_first_step_s = time.perf_counter() - self.t_start
    self.mark(step)

  def mark(self, step: int, at: float | None = None) -> None:
    """The next interval starts now (or at time.perf_counter() value `at`), after `step` (evaluation and saving
    stay out of the rate)."""
    self.last_t, self.last_step = time.perf_counter() if at is None else at, step

  def interval(self, step: int, now: float | None = None) -> dict:
    """steps_per_s, tokens_per_s and mfu from the last mark to now (a time.perf_counter() value; default: the
    clock), `step` steps done by then (none if no step ran since the mark)."""
    fields = {} if self.reported else {"time_to_first_step_s": self.time_to_first_step_s}
    self.reported = True
    if step <= self.last_step:
      return fields
    rate = (step - self.last_step) / ((time.perf_counter() if now is None else now) - self.last_t)
    self.rates.append(rate)
    return self.rates_fields(rate) | fields

  def rates_fields(self, steps_per_s: float | None) -> dict:
    tokens_per_s = steps_per_s and steps_per_s * self.tokens_per_step
    mfu = tokens_per_s * self.flops_per_token / self.peak if self.peak and tokens_per_s else None
    return {"steps_per_s": steps_per_s, "tokens_per_s": tokens_per_s, "mfu": mfu}

  def steady_steps_per_s(self) -> float | None:
    steady = sorted(self.rates[1:] or self.rates)
    return steady[len(steady) // 2] if steady else None


def dumps(record: dict) -> str:
  """One JSON line that strict parsers read: a non-finite float (a diverged loss) is written as the string
  "NaN", "Infinity" or "-Infinity", as the protobuf JSON mapping writes them (float() reads them back), where
  json.dumps would write bare NaN, which is not JSON."""
  def finite(x):
    if isinstance(x, float) and not math.isfinite(x):
      return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
      return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [finite(v) for v in x]
    return x
  return json.dumps(finite(record), allow_nan=False)


NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def loads(line: str) -> dict:
  """A record `dumps` wrote, its non-finite numbers (the strings NON_FINITE names, at any key but a text one)
  floats again."""
  text = ("sample", "sample_prompt")  # the run's free text, which may read "NaN"
  def number(record):
    return {k: NON_FINITE.get(v, v) if isinstance(v, str) and k not in text else v for k, v in record.items()}
  return json.loads(line, object_hook=number)


class MetricsWriteError(RuntimeError):
  """A record could not be appended to the metrics file; the message names it and what to do."""


def _check_records(path: str) -> None:
  """ValueError unless the existing file `path` is empty or starts with a JSON record: records appended to a file
  of other text (notes, a script, a binary) would damage it. A device (/dev/null) is not read."""
  if not os.path.isfile(path):
    return
  with open(path, "rb") as f:
    first = f.readline(1 << 20)
  if not first.strip():
    return
  try:
    record = json.loads(first)
  except ValueError:  # UnicodeDecodeError too
    record = None
  if not isinstance(record, dict):
    raise ValueError(f"--metrics {path}: holds other text (its first line is not a JSON record), and records would "
                     "be appended to it; give a new file, or one a run wrote its records to")


class MetricsFile:
  """Appends one JSON object a line; a resumed run keeps appending to the same file."""

  def __init__(self, path: str | None):
    self.path = path
    self.file = None
    self.created = False  # this process created the file: discard_if_empty may remove it
    if path and jax.process_index() == 0:
      if os.path.isdir(path):
        raise ValueError(f"--metrics {path}: is a folder; give a file path (JSON lines are appended to it)")
      try:
        try:
          self.file, self.created = open(path, "x", encoding="utf-8"), True
        except FileExistsError:
          _check_records(path)
          self.file = open(path, "a", encoding="utf-8")
      except OSError as e:
        raise ValueError(f"--metrics {path}: cannot write there ({e.strerror})") from None

  def discard_if_empty(self) -> list[str]:
    """Closes the file, and removes it where this process created it and nothing was written to it (the run was
    refused or stopped before its first record); a file that was there before stays as it was. Returns [its path]
    where it removed it, else []."""
    removed = []
    if self.file and not self.file.closed and self.created:
      fd = self.file.fileno()
      if os.fstat(fd).st_size == 0 and undo.is_open_at(fd, self.path):
        os.remove(self.path)
        removed.append(self.path)
    self.close()
    return removed

  def write(self, record: dict) -> None:
    if self.file:
      try:
        self.file.write(dumps(record) + "\n")
        self.file.flush()
      except OSError as e:  # a full disk, a device that takes no writes (/dev/full)
        raise MetricsWriteError(f"--metrics {self.path}: cannot append a record ({e.strerror or e}); the run stops "
                                "here, and the checkpoints it saved are kept: free room there, or give --metrics "
                                "another file, and run again to resume") from None

  def close(self) -> None:
    if self.file:
      try:
        self.file.close()
      except OSError:  # the record a failed write left in the buffer: write() has raised MetricsWriteError for it
        pass
