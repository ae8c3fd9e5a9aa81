#!/usr/bin/env bash
# Regenerates the TPU results on one TPU v5e chip: jax with libtpu, and flax, optax and orbax-checkpoint installed
# (on the device tool's tpu-v5e kind, from the machine's own index). Run from the repository root:
# `bash benchmarks/tpu.sh [OUT] [PART]`. OUT defaults to benchmarks/results/tpu-v5e; PART (default all) runs one of:
# blocks, layer, heads, packing, train, so that each part fits in one 10-minute device command; `report` (no TPU
# needed) then merges the layer parts' runs into OUT/layer.md and OUT/packing/layer.md. Every program runs alone:
# a TPU admits one process at a time (benchmarks.train's parent leaves it to each training run).
set -euo pipefail
OUT=${1:-benchmarks/results/tpu-v5e}
PART=${2:-all}
PARTS=${PARTS:-runs/tpu-parts}  # per-part layer.json files, merged into OUT by the report part
mkdir -p "$OUT" "$PARTS"
if [[ $PART == all || $PART == blocks ]]; then
  python -m benchmarks.splash_blocks --out "$OUT"  # the measurement behind splash's block table
fi
if [[ $PART == all || $PART == layer ]]; then
  # T 512 ... 8192 at both levels (xla runs out of HBM at T8192), then T16384 on the core alone
  python -m benchmarks.layer --sections seq --levels core layer --seqs 512 1024 2048 4096 8192 --backends xla splash \
    --calls 10 --out "$PARTS/seq"
  python -m benchmarks.layer --sections seq --levels core --seqs 16384 --backends xla splash --out "$PARTS/long"
fi
if [[ $PART == all || $PART == heads ]]; then
  python -m benchmarks.layer --sections heads --levels core layer --backends xla splash --calls 10 --out "$PARTS/heads"
fi
if [[ $PART == all || $PART == packing ]]; then
  python -m benchmarks.layer --sections segments window --levels core --backends xla splash --calls 10 \
    --out "$PARTS/packing"
  python -m benchmarks.train --backends splash --packing unpacked packed --seq-len 1024 --batch-size 8 --steps 20 \
    --run-timeout 240 --out "$OUT/packing"
fi
if [[ $PART == all || $PART == train ]]; then
  python -m benchmarks.train --backends xla splash --seq-len 1024 4096 --batch-size 8 2 --steps 20 \
    --run-timeout 240 --out "$OUT"
fi
if [[ $PART == all || $PART == report ]]; then
  runs=()
  for part in seq long heads; do [[ -f $PARTS/$part/layer.json ]] && runs+=("$PARTS/$part/layer.json"); done
  (( ${#runs[@]} )) && python -m benchmarks.layer --merge "${runs[@]}" --out "$OUT"
  if [[ -f $PARTS/packing/layer.json ]]; then
    python -m benchmarks.layer --merge "$PARTS/packing/layer.json" --out "$OUT/packing"
  fi
fi
