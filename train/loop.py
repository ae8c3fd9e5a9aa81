"""The training loop: data-parallel over every device, checkpointed, resumable, measured."""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

import models
from attnlayers.fp8 import FP8Meta
from train import checkpoint, data, metrics, optim, sample


class TrainingDiverged(RuntimeError):
  pass


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: models.GPTConfig
  steps: int = 1000  # optimizer steps in all, counting those before a resume
  batch_size: int = 16  # global batch, split over every device
  lr: float = 3e-3  # peak learning rate
  warmup: int = 30  # linear warm-up steps
  weight_decay: float = 0.1
  clip: float = 1.0  # global gradient norm
  seed: int = 0  # parameters, data order and dropout
  data: str | None = None  # see train.data; None = the embedded corpus
  ckpt_dir: str | None = None  # resume from and save to; None = no checkpoints
  ckpt_every: int = 100
  eval_every: int = 100
  eval_batches: int = 4
  log_every: int = 10
  metrics: str | None = None  # JSONL path
  sample_tokens: int = 200  # printed at the end; 0 = none
  peak_tflops: float | None = None  # override the device's bf16 peak for MFU
  progress: bool = True
  profile_dir: str | None = None  # write a profiler trace (perfetto + xplane) of steps 11-15 here


def _loss(graphdef, params, fp8, x, y, dropout_key):
  model = nnx.merge(graphdef, params, fp8)
  rngs = nnx.Rngs(dropout=dropout_key) if model.cfg.dropout else None
  logits = model(x, rngs=rngs)  # (B, T, V) float32
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def run(cfg: TrainConfig) -> dict:
  """Trains; returns the summary. Raises TrainingDiverged on a non-finite loss."""
  t_start = time.perf_counter()
  mcfg = cfg.model
  dataset = data.load(cfg.data, mcfg.seq_len)
  if dataset.vocab_size > mcfg.vocab_size:
    raise ValueError(f"data {dataset.name} has token ids up to {dataset.vocab_size - 1}, more than the model's "
                     f"vocab_size {mcfg.vocab_size}; use --vocab-size {dataset.vocab_size} or larger")
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))  # XLA SPMD partitions
  if cfg.batch_size % jax.device_count():
    raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the {jax.device_count()} devices")
  replicated, batch_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

  model = models.GPT(mcfg, rngs=nnx.Rngs(cfg.seed))
  # fp8: FP8 scaling state (te-fp8 only, else empty); replaced by its gradient each step, never optimised
  graphdef, params, fp8 = nnx.split(model, nnx.Param, FP8Meta)
  if fp8 and jax.device_count() > 1:
    raise ValueError(f"--attn te-fp8 trains on one device in this version (its amax reductions are not "
                     f"wired across devices); have {jax.device_count()}")
  n_params = models.count_params(model)
  tx = optim.adamw(cfg.lr, cfg.steps, cfg.warmup, weight_decay=cfg.weight_decay, clip=cfg.clip)
  state = jax.device_put({"params": params, "opt_state": tx.init(params), "fp8": fp8}, replicated)
  lr_at = optim.schedule(cfg.lr, cfg.steps, cfg.warmup)

  meta = {"model": mcfg.architecture(), "seed": cfg.seed, "data": dataset.name}
  ckpts = checkpoint.Checkpoints(cfg.ckpt_dir) if cfg.ckpt_dir else None
  start = 0
  if ckpts and ckpts.latest_step() is not None:
    start = ckpts.latest_step()
    state, _ = ckpts.restore(start, state, meta)
    print(f"resumed from {ckpts.directory} at step {start}")

  @functools.partial(jax.jit, donate_argnums=0)  # the old state's buffers hold the new one
  def train_step(state, x, y, step):
    key = jax.random.fold_in(jax.random.key(cfg.seed), step)  # dropout depends on (seed, step) only
    loss, (grads, fp8) = jax.value_and_grad(lambda p, f: _loss(graphdef, p, f, x, y, key), argnums=(0, 1))(
        state["params"], state["fp8"])  # the FP8Meta "gradient" is its updated value (attnlayers.fp8)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state, "fp8": fp8}, loss

  @jax.jit
  def eval_loss(params, fp8, x, y):
    return _loss(graphdef, params, fp8, x, y, None)

  local = cfg.batch_size // jax.process_count()
  lo = jax.process_index() * local

  def put(split, step):
    x, y = dataset.batch(split, cfg.seed, step, cfg.batch_size, mcfg.seq_len)
    return (jax.make_array_from_process_local_data(batch_sharding, a[lo:lo + local]) for a in (x, y))

  def validate():
    losses = [eval_loss(state["params"], state["fp8"], *put("val", i)) for i in range(cfg.eval_batches)]
    return float(np.mean([float(l) for l in losses]))

  def check_finite(loss, step):
    if not math.isfinite(loss):
      good = ckpts.latest_step() if ckpts else None
      where = f"the last good checkpoint, step {good} in {ckpts.directory}, is untouched" if good is not None \
          else "no checkpoint was written"
      raise TrainingDiverged(f"loss is {loss} at step {step}; stopped: {where}. Lower --lr or raise --warmup.")

  tokens_per_step = cfg.batch_size * mcfg.seq_len
  fpt = models.flops_per_token(mcfg, n_params, mcfg.seq_len)
  peak = metrics.peak_flops(cfg.peak_tflops)
  mfu = lambda steps_per_s: steps_per_s * tokens_per_step * fpt / peak if peak and steps_per_s else None
  out = metrics.MetricsFile(cfg.metrics)
  bar = tqdm(total=cfg.steps, initial=start, disable=not cfg.progress or jax.process_index() != 0, unit="step")
  rates, first_step_s, last_t, last_step, loss, wrote_any = [], None, None, start, None, False
  try:
    batch = put("train", start + 1)
    for step in range(start + 1, cfg.steps + 1):
      if cfg.profile_dir and step == start + 11:
        jax.profiler.start_trace(cfg.profile_dir, create_perfetto_trace=True)
      state, loss_arr = train_step(state, *batch, step)
      if step < cfg.steps:
        batch = put("train", step + 1)  # the next batch is made while this step runs
      if cfg.profile_dir and step == start + 15:
        jax.block_until_ready(loss_arr)
        jax.profiler.stop_trace()
      bar.update(1)
      if first_step_s is None:
        loss = float(loss_arr)
        first_step_s = time.perf_counter() - t_start
        last_t, last_step = time.perf_counter(), step
        check_finite(loss, step)
      is_log = step % cfg.log_every == 0 or step == cfg.steps
      is_eval = cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps)
      is_ckpt = ckpts and (step % cfg.ckpt_every == 0 or step == cfg.steps)
      if not (is_log or is_eval or is_ckpt):
        continue
      loss = float(loss_arr)  # waits for the step
      check_finite(loss, step)
      now = time.perf_counter()
      record = {"step": step, "loss": loss, "lr": float(lr_at(step - 1))}
      if step > last_step:
        steps_per_s = (step - last_step) / (now - last_t)
        rates.append(steps_per_s)
        record |= {"steps_per_s": steps_per_s, "tokens_per_s": steps_per_s * tokens_per_step,
                   "mfu": mfu(steps_per_s)}
      if not wrote_any:
        record["time_to_first_step_s"] = first_step_s
      if is_eval:
        record["val_loss"] = validate()
      if is_ckpt:
        ckpts.save(step, state, meta)
      out.write(record)
      wrote_any = True
      bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record.get('tokens_per_s', 0):,.0f}")
      last_t, last_step = time.perf_counter(), step
  finally:
    bar.close()
    out.close()
    if ckpts:
      ckpts.close()

  steady = sorted(rates[1:] or rates)  # the first interval, just after compilation, still warms up
  steps_per_s = steady[len(steady) // 2] if steady else None
  summary = {
      "event": "summary", "steps": cfg.steps, "final_loss": loss, "params": n_params,
      "steps_per_s": steps_per_s, "tokens_per_s": steps_per_s and steps_per_s * tokens_per_step,
      "mfu": mfu(steps_per_s),
      "time_to_first_step_s": first_step_s, "peak_memory_bytes": metrics.peak_memory_bytes(),
      "attention": mcfg.backend, "device": str(jax.local_devices()[0].device_kind), "devices": jax.device_count(),
  }
  if cfg.sample_tokens:  # every process takes part: the parameters span all of them
    prompt = dataset.val[0][:mcfg.seq_len // 2]
    new = sample.generate(graphdef, (state["params"], state["fp8"]), np.asarray(prompt), steps=cfg.sample_tokens,
                          window=mcfg.seq_len, seed=cfg.seed)
    summary["sample"] = sample.decode(new, dataset.vocab_size)
  return summary
