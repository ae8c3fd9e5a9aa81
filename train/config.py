"""The training run's settings (`TrainConfig`), checked where they are made, before any work.

Whether the run's outputs lie where its data is read is train.overlap's check, which reads the file system: its
callers make it (train.checks on the flags, train.loop.run on the config) with the walk of the --data folder they
hand on to load, not TrainConfig on each of its copies."""

from __future__ import annotations

import dataclasses
import math

import models
from train import optim

PROFILE_WINDOW = (11, 15)  # steps traced with profile_dir, counted from the run's first step (1)
# The settings that, with the model's architecture, seed and data, decide every step's numbers:
# a resume must keep them unless TrainConfig.allow_change names them.
TRAJECTORY = ("steps", "batch_size", "lr", "warmup", "lr_schedule", "weight_decay", "decay_rule", "clip", "dtype")
DATA = "data"  # allow_change may name it too: the data's path and content (other data, or the same rewritten)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: models.GPTConfig
  steps: int = 1000  # optimizer steps in all, counting those before a resume
  batch_size: int = 16  # global batch, split over every device
  lr: float = 3e-3  # peak learning rate
  warmup: int = 30  # linear warm-up steps
  weight_decay: float = 0.1  # AdamW decay on matrices
  clip: float = 1.0  # global gradient norm
  seed: int = 0  # parameters, data order and dropout
  data: str | None = None  # see train.data; None = the installed Python's standard library sources
  data_raw_bytes: bool = False  # train on files of data that are mostly not text, as bytes; False = refuse them
  ckpt_dir: str | None = None  # resume from and save to; None = no checkpoints
  ckpt_every: int = 100  # steps between checkpoints (the last step is always saved)
  eval_every: int = 100  # steps between validation losses; 0 = none
  eval_batches: int = 4  # validation batches averaged per evaluation
  log_every: int = 10  # steps between metrics records
  metrics: str | None = None  # JSONL path
  sample_tokens: int = 200  # sampled at the end, at most seq_len - seq_len // 4 (the prompt takes the rest); 0 = none
  peak_tflops: float | None = None  # override the device's bf16 peak for MFU
  progress: bool = True  # tqdm bar
  profile_dir: str | None = None  # write a profiler trace (perfetto + xplane) of PROFILE_WINDOW here
  allow_change: tuple[str, ...] = ()  # TRAJECTORY settings (and DATA) a resume may change; recorded in the metrics file
  pack: bool = False  # train on packed documents (train.packing); validation is unpacked windows either way
  mesh: str | None = None  # --mesh "data=D,fsdp=F,tensor=T" (train.mesh); None: every device on data

  def __post_init__(self):
    finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)
    rules = [("steps", self.steps >= 1, ">= 1"), ("batch_size", self.batch_size >= 1, ">= 1"),
             ("lr", finite(self.lr) and self.lr > 0, "a finite number > 0"), ("warmup", self.warmup >= 0, ">= 0"),
             ("weight_decay", finite(self.weight_decay) and self.weight_decay >= 0, "a finite number >= 0"),
             ("clip", finite(self.clip) and self.clip > 0, "a finite number > 0"),
             ("seed", 0 <= self.seed < 2**32, "in [0, 2**32): jax.random.key keeps a seed's low 32 bits, so seed "
              "2**32 + s would initialise the model as s does"),
             ("ckpt_every", self.ckpt_every >= 1, ">= 1"), ("eval_every", self.eval_every >= 0, ">= 0"),
             ("eval_batches", self.eval_batches >= 1, ">= 1"), ("log_every", self.log_every >= 1, ">= 1"),
             ("sample_tokens", self.sample_tokens >= 0, ">= 0"),
             ("peak_tflops", self.peak_tflops is None or finite(self.peak_tflops) and self.peak_tflops > 0, "> 0"),
             ("allow_change", set(self.allow_change) <= {*TRAJECTORY, DATA}, f"some of {', '.join(TRAJECTORY)}, {DATA}")]
    bad = [f"{name} must be {rule}, got {getattr(self, name)!r}" for name, ok, rule in rules if not ok]
    if self.profile_dir and self.steps < PROFILE_WINDOW[1]:
      first, last = PROFILE_WINDOW
      bad.append(f"--profile-dir traces steps {first}-{last} of the run, but --steps is {self.steps}: give --steps "
                 f"{last} or more, or leave out --profile-dir")
    if bad:
      raise ValueError("; ".join(bad))

  def trajectory(self) -> dict:
    """The TRAJECTORY settings' values, which a checkpoint records (checkpoint.check_meta)."""
    rules = {"dtype": self.model.dtype, "lr_schedule": optim.LR_SCHEDULE, "decay_rule": optim.DECAY_RULE}
    return {f: rules[f] if f in rules else getattr(self, f) for f in TRAJECTORY}
