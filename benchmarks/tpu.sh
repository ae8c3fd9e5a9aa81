#!/usr/bin/env bash
# Regenerates the TPU results on one TPU v5e chip: jax with libtpu, and flax, optax and orbax-checkpoint installed
# (on the device tool's tpu-v5e kind, from the machine's own index). Run from the repository root:
# `bash benchmarks/tpu.sh [OUT] [PART]`. OUT defaults to benchmarks/results/tpu-v5e; PART (default all) runs one of:
# blocks, layer, packing, train, so that each part fits in one 10-minute device command. Every program runs alone:
# a TPU admits one process at a time (benchmarks.train's parent leaves it to each training run).
set -euo pipefail
OUT=${1:-benchmarks/results/tpu-v5e}
PART=${2:-all}
mkdir -p "$OUT"
if [[ $PART == all || $PART == blocks ]]; then
  python -m benchmarks.splash_blocks --out "$OUT"  # the measurement behind splash's block table
fi
if [[ $PART == all || $PART == layer ]]; then
  python -m benchmarks.layer --sections seq --levels core layer --seqs 1024 4096 8192 16384 --backends xla splash \
    --out "$OUT"
fi
if [[ $PART == all || $PART == packing ]]; then
  python -m benchmarks.layer --sections segments window --levels core --backends xla splash --out "$OUT/packing"
  python -m benchmarks.train --backends splash --packing unpacked packed --seq-len 1024 --batch-size 8 --steps 20 \
    --run-timeout 240 --out "$OUT/packing"
fi
if [[ $PART == all || $PART == train ]]; then
  python -m benchmarks.train --backends xla splash --seq-len 1024 4096 --batch-size 8 2 --steps 20 \
    --run-timeout 240 --out "$OUT"
fi
