#!/usr/bin/env bash
# Regenerates benchmarks/results/h200 (or $1) on one NVIDIA GPU with TransformerEngine installed.
# Run from the repository root. Each step fits in 10 minutes on an H200; the published
# results were made by running these steps one by one.
set -euo pipefail
OUT=${1:-benchmarks/results/h200}
PARTS=$(mktemp -d)
python -m benchmarks.train --seq-len 1024 8192 --batch-size 32 4 --steps 20 --run-timeout 90 --out "$OUT"
python -m benchmarks.fp8 --out "$OUT"
python -m benchmarks.fp8_train --out "$OUT"
python -m benchmarks.wrapper --rounds 4 --out "$OUT"
python -m benchmarks.layer --sections seq --levels core --seqs 256 1024 4096 16384 --out "$PARTS/seq"
python -m benchmarks.layer --sections default --out "$PARTS/more-default"
python -m benchmarks.layer --sections heads headdim --levels core --out "$PARTS/more"
python -m benchmarks.layer --sections seq --levels layer --seqs 256 1024 4096 16384 --out "$PARTS/seq-layer"
python -m benchmarks.layer --sections batch --levels core --batches 1 4 16 --out "$PARTS/batch"
python -m benchmarks.layer --merge "$PARTS/more-default/layer.json" "$PARTS/more/layer.json" "$PARTS/seq/layer.json" \
    "$PARTS/seq-layer/layer.json" "$PARTS/batch/layer.json" --out "$OUT"
python -m benchmarks.summary "$OUT"
