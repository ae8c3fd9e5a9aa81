"""What one training run reads as it steps: its batches and its Session.

train.loop makes them and runs the steps; train.report reads a Session for the summary. Apart from both, so
that neither imports the other's module for them.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding

import attnlayers
from train import checkpoint, data, metrics, signals
from train.config import TrainConfig
from train.step import Model

BATCH_FIELDS = ("inputs", "targets", "segment_ids", "positions")  # a packed batch's arrays; unpacked: the first two


@dataclasses.dataclass(frozen=True)
class Batches:
  """Step s's batch on the devices: every process cuts its rows out of the same global batch.

  A batch is a dict of int32 (B, T) arrays named by BATCH_FIELDS: packed training rows carry
  all four, validation (and unpacked training) windows inputs and targets only."""
  dataset: data.Dataset  # the token source
  cfg: TrainConfig  # seed, batch size, sequence length, packing
  sharding: NamedSharding  # rows split over the "data" axis

  def __call__(self, split: str, step: int) -> dict:
    local = self.cfg.batch_size // jax.process_count()
    lo = jax.process_index() * local
    if self.cfg.pack and split == "train":
      arrays = self.dataset.packed_batch(self.cfg.seed, step, self.cfg.batch_size)
    else:
      arrays = self.dataset.batch(split, self.cfg.seed, step, self.cfg.batch_size, self.cfg.model.seq_len)
    return {name: jax.make_array_from_process_local_data(self.sharding, a[lo:lo + local])
            for name, a in zip(BATCH_FIELDS, arrays)}


@dataclasses.dataclass(frozen=True)
class Session:
  """Everything the loop reads; the state it trains is passed along explicitly."""
  cfg: TrainConfig  # the run's settings
  model: Model  # step functions
  batches: Batches  # batch of (split, step)
  ckpts: checkpoint.Checkpoints | None  # None without ckpt_dir
  meta: dict  # what each checkpoint records about the run (checkpoint.check_meta)
  out: metrics.MetricsFile  # the JSONL metrics
  throughput: metrics.Throughput  # steps/s between reports
  stop: signals.StopRequests  # SIGINT/SIGTERM received, if any
  start: int  # the step the run resumed from (0 = fresh)
  attention_plans: list[attnlayers.Plan]  # how the step's attention calls run (train.report.check_attention's)
  val_loss: dict = dataclasses.field(default_factory=dict)  # step -> validation loss, this process's evaluations
