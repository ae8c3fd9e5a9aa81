"""`python -m train`: train the GPT decoder with a chosen attention backend and measure it."""

from __future__ import annotations

import argparse
import json
import sys

import jax

import attnlayers
import models
from attnlayers.fp8 import FP8Unavailable
from train import checkpoint, loop


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
  p.add_argument("--attn", choices=attnlayers.BACKENDS, default="auto", help="attention backend (default: auto)")
  p.add_argument("--preset", choices=list(models.PRESETS), default="tiny")
  p.add_argument("--n-layer", type=int, help="transformer blocks; default: the preset's")
  p.add_argument("--n-head", type=int, help="query heads; default: the preset's")
  p.add_argument("--d-model", type=int, help="model width (head dim = d_model / n_head); default: the preset's")
  p.add_argument("--kv-heads", type=int, help="key/value heads (GQA/MQA); default: the preset's")
  p.add_argument("--seq-len", type=int, help="context length; default: the preset's")
  p.add_argument("--vocab-size", type=int, help="default: the preset's")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype; default: the preset's")
  p.add_argument("--batch-size", type=int, default=16, help="global batch (default 16)")
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=30)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--data", help="text file, folder of text, or 'DIR/*.bin' token shards; default: "
                                "the Python standard library's source, embedded")
  p.add_argument("--ckpt-dir", help="save checkpoints here and resume from the latest one")
  p.add_argument("--ckpt-every", type=int, default=100)
  p.add_argument("--eval-every", type=int, default=100)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--metrics", help="append JSON lines here")
  p.add_argument("--sample-tokens", type=int, default=200)
  p.add_argument("--peak-tflops", type=float, help="device bf16 peak for MFU, if not in the built-in table")
  p.add_argument("--no-progress", dest="progress", action="store_false")
  p.add_argument("--profile-dir", help="write a profiler trace of steps 11-15 here (perfetto_trace.json.gz + xplane)")
  p.add_argument("--coordinator-address", help="multi-host: host:port of process 0 (with --num-processes, --process-id)")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  return p


def main(argv=None) -> None:
  a = parser().parse_args(argv)
  if a.coordinator_address:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk through gloo
    jax.distributed.initialize(a.coordinator_address, num_processes=a.num_processes, process_id=a.process_id)
  try:
    model = models.preset(a.preset, backend=a.attn, n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model,
                          n_kv_head=a.kv_heads, seq_len=a.seq_len, vocab_size=a.vocab_size, dtype=a.dtype)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  cfg = loop.TrainConfig(
      model=model, steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup=a.warmup, seed=a.seed, data=a.data,
      ckpt_dir=a.ckpt_dir, ckpt_every=a.ckpt_every, eval_every=a.eval_every, log_every=a.log_every,
      metrics=a.metrics, sample_tokens=a.sample_tokens, peak_tflops=a.peak_tflops, progress=a.progress,
      profile_dir=a.profile_dir)
  print(f"{a.preset}: {model}\n{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  try:
    summary = loop.run(cfg)
  except (loop.TrainingDiverged, checkpoint.ResumeMismatchError, attnlayers.BackendUnavailableError,
          FP8Unavailable, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  sample = summary.pop("sample", None)
  if jax.process_index() != 0:
    return
  print(json.dumps(summary))
  if sample is not None:
    print("sample:\n" + sample)


if __name__ == "__main__":
  main()
