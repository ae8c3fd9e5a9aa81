#!/usr/bin/env bash
# Regenerates the published results on one NVIDIA GPU with TransformerEngine installed.
# Run from the repository root: `bash benchmarks/h200.sh [OUT] [PART]`. OUT defaults to
# benchmarks/results/h200; PART (default all) runs one of: kernels, layer, packing, train, speed, bias, decode, decode-options, so
# that each part fits in one 10-minute device command. `summary` (no GPU needed) then writes
# benchmarks/RESULTS.md from OUT.
set -euo pipefail
OUT=${1:-benchmarks/results/h200}
PART=${2:-all}
PARTS=${PARTS:-runs/h200-parts}  # per-part layer.json files, merged into OUT by the summary part
mkdir -p "$OUT" "$PARTS"
if [[ $PART == all || $PART == kernels ]]; then
  python -m benchmarks.fp8 --out "$OUT"
  python -m benchmarks.wrapper --rounds 3 --seqs 1024 16384 --out "$OUT"
  python -m benchmarks.layer --sections default heads headdim --levels core --out "$PARTS/more"
fi
if [[ $PART == all || $PART == layer ]]; then
  python -m benchmarks.layer --sections seq --levels core layer --seqs 1024 4096 16384 --out "$PARTS/seq"
  python -m benchmarks.layer --sections batch --levels core --batches 1 16 --out "$PARTS/batch"
fi
if [[ $PART == all || $PART == packing ]]; then
  # Packed documents (core and layer) and causal sliding windows (core), each row against its baseline timed
  # in the same process, into OUT/packing, then packed vs unpacked gpt2-small training. On the H200 the core
  # rows of xla/cudnn/te (segments, 36 rows) and cudnn/te (window, 48 rows) took under 90 s and 130 s, the
  # training runs about 100 s; every backend and the layer level together: several minutes, not yet timed.
  python -m benchmarks.layer --sections segments --levels core layer --out "$PARTS/segments"
  python -m benchmarks.layer --sections window --levels core --out "$PARTS/window"
  python -m benchmarks.layer --merge "$PARTS/segments/layer.json" "$PARTS/window/layer.json" --out "$OUT/packing"
  python -m benchmarks.train --backends cudnn te --packing unpacked packed --seq-len 1024 --batch-size 32 \
    --steps 30 --run-timeout 70 --out "$OUT/packing"
fi
if [[ $PART == all || $PART == train ]]; then
  python -m benchmarks.train --seq-len 1024 8192 --batch-size 32 4 --steps 20 --run-timeout 90 --out "$OUT"
  python -m benchmarks.fp8_train --out "$OUT"
fi
if [[ $PART == all || $PART == speed ]]; then
  # Training speed by preset, each in its own folder (each run its own matmul yardstick), then the 300-step
  # gpt-1b loss comparison; split the lines over device commands where the 10-minute limit needs it
  python -m benchmarks.train --backends cudnn te te-fp8 --run-timeout 60 --out "$OUT/gpt2-small"
  python -m benchmarks.steady --attn cudnn --out "$OUT/gpt2-small"
  python -m benchmarks.train --preset gpt2-medium --backends cudnn te te-fp8 --run-timeout 80 --out "$OUT/gpt2-medium"
  python -m benchmarks.train --preset gpt-1b --seq-len 2048 --batch-size 8 --backends cudnn te te-fp8 --steps 20 \
    --run-timeout 80 --out "$OUT/gpt-1b"
  python -m benchmarks.fp8_train --preset gpt-1b --baseline cudnn --seq-len 2048 --batch-size 8 --steps 300 --lr 6e-4 \
    --out "$OUT/gpt-1b"
fi
if [[ $PART == all || $PART == bias ]]; then
  # gpt2-small and gpt2-medium with GPT-2's biases and without (train --no-bias, nanoGPT's train.py default),
  # side by side; about 210 s, 110 s and 100 s on the H200 (the alternated repeats in gpt2-small/bias-alternated*
  # are the second line's 40-step form, --backends cudnn cudnn)
  python -m benchmarks.train --backends cudnn te te-fp8 --bias with without --out "$OUT/gpt2-small/bias"
  python -m benchmarks.train --backends cudnn --bias with without --steps 300 --out "$OUT/gpt2-small/bias-steps300"
  python -m benchmarks.train --preset gpt2-medium --backends cudnn --bias with without --out "$OUT/gpt2-medium/bias"
fi
if [[ $PART == all || $PART == decode ]]; then
  # ~3 minutes: time to first token for every backend, then backend by backend (cudnn first) K 12/4/1 x
  # B 1/64 x contexts 512/2048/8192 until the budget is spent; the points not run are rows saying so
  python -m benchmarks.decode --batches 1 64 --budget-s 150 --out "$OUT"
  # the same step's kernels as its compiled loop counts them (benchmarks.kernels)
  python -m benchmarks.kernels --out "$OUT/decode-kernels"
fi
if [[ $PART == all || $PART == decode-options ]]; then
  # ~5 minutes: cudnn's decode under each set of XLA options, K 12/4/1 at the targets' points (batch 1 at context
  # 1536, batch 64 at 2048); the sets without command buffers (default, unsplit) count the kernels a step runs in
  # a trace, which CUDA graphs hide, so they run first: a budget that runs out still leaves the counts
  python -m benchmarks.decode --backends cudnn --batches 1 64 --contexts 2048 --xla-options default unsplit graphs \
    --budget-s 300 --out "$OUT/decode-options"
fi
if [[ $PART == all || $PART == summary ]]; then
  python -m benchmarks.layer --merge "$PARTS/more/layer.json" "$PARTS/seq/layer.json" "$PARTS/batch/layer.json" --out "$OUT"
  python -m benchmarks.summary "$OUT"
fi
