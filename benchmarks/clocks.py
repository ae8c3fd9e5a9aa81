"""A GPU's SM clock and power while a benchmark runs, from one `nvidia-smi -lms` process read in a thread.

Why: a GPU whose work draws the board's power limit runs under the driver's software power cap
(throttle reason 0x4), at an SM clock below its boost clock, and a long training step can; a ratio
like vs_matmul compares two programs at whatever clocks each ran, so each run reports them. Samples taken while the GPU
is idle (compiling, loading) say nothing about the work, so only busy ones (utilization >= BUSY)
are summarised. power.draw is nvidia-smi's own average (about 1 s on recent GPUs).

No nvidia-smi (a CPU machine): no samples, summary fields None. An nvidia-smi that fails or prints
lines that do not parse: the summary's `error` says what it printed, or its exit code.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading

FIELDS = "clocks.sm,clocks.max.sm,power.draw,power.limit,utilization.gpu,clocks_throttle_reasons.active"
SW_POWER_CAP = 0x4  # nvidia-smi's clocks_throttle_reasons bit for the software power cap
BUSY = 90  # % utilization from which a sample counts as the work's
KEYS = ("sm_mhz", "sm_max_mhz", "power_w", "power_limit_w", "power_capped_share")


def parse(line: str) -> dict | None:
  """One `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits` line -> a sample; None if unreadable."""
  parts = [p.strip() for p in line.split(",")]
  if len(parts) != 6:
    return None
  try:
    sm, sm_max, power, limit, util = (float(p) for p in parts[:5])
    reasons = int(parts[5], 16)
  except ValueError:
    return None
  return {"sm_mhz": sm, "sm_max_mhz": sm_max, "power_w": power, "power_limit_w": limit, "util": util,
          "power_capped": bool(reasons & SW_POWER_CAP)}


def summarize(samples: list[dict]) -> dict:
  """Medians over the busy samples: sm_mhz, power_w, the share of them under the software power cap, and
  how many there were (busy_samples); the board's sm_max_mhz and power_limit_w from any sample."""
  busy = [s for s in samples if s["util"] >= BUSY]
  out = dict.fromkeys(KEYS) | {"busy_samples": len(busy)}
  if samples:
    out |= {"sm_max_mhz": samples[-1]["sm_max_mhz"], "power_limit_w": samples[-1]["power_limit_w"]}
  if busy:
    med = lambda k: statistics.median(s[k] for s in busy)
    out |= {"sm_mhz": med("sm_mhz"), "power_w": med("power_w"),
            "power_capped_share": sum(s["power_capped"] for s in busy) / len(busy)}
  return out


def gpu_index() -> str:
  """nvidia-smi's index of the GPU the process computes on: the first of CUDA_VISIBLE_DEVICES, else 0."""
  first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
  return first or "0"


class Sampler:
  """`with Sampler() as s: work()` then `s.summary()`: samples every `period_ms` while inside."""

  def __init__(self, period_ms: int = 250):
    self.period_ms = period_ms
    self.samples: list[dict] = []
    self.unparsed: list[str] = []  # lines that were not a sample (an error message, an unknown field)
    self._proc = None
    self._reader = None
    self._exit_code = None  # nvidia-smi's, where it ended by itself (it samples until stopped)

  def __enter__(self) -> Sampler:
    cmd = shutil.which("nvidia-smi")
    if cmd:
      self._proc = subprocess.Popen(
          [cmd, "-i", gpu_index(), f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      self._reader = threading.Thread(target=self._read, daemon=True)
      self._reader.start()
    return self

  def _read(self) -> None:
    for line in self._proc.stdout:
      sample = parse(line)
      if sample:
        self.samples.append(sample)
      elif line.strip():
        self.unparsed.append(line.strip())

  def __exit__(self, *exc) -> None:
    if self._proc is None:
      return
    self._exit_code = self._proc.poll()
    self._proc.terminate()
    try:
      self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait(timeout=5)
    self._reader.join(timeout=5)

  def summary(self) -> dict:
    """summarize(samples), with `error`: what nvidia-smi printed instead of samples, if it did."""
    error = None
    if self._proc is not None and self.unparsed:
      error = f"nvidia-smi printed {len(self.unparsed)} line(s) that are not samples, first: {self.unparsed[0]!r}"
    elif self._exit_code:
      error = f"nvidia-smi exited with code {self._exit_code} before it was stopped, printing nothing"
    return summarize(self.samples) | {"error": error}
