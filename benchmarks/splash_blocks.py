"""`python -m benchmarks.splash_blocks`: the block sizes of splash's table, measured on the TPU at hand.

Times causal attention forward + backward (bfloat16, the gradient of the output's sum with respect to q, k and
v) through splash's own kernel (attnlayers.backends.splash._kernel) at each candidate block size, and XLA's
attention (backend='xla') in the same run, for MHA and GQA shapes at T = 1024 ... 8192. Each row: the median of
`--calls` calls and the 10th-90th percentile, the ratio xla / splash (same run), and the largest |dq| difference
from xla's. A candidate the kernel cannot compile (its VMEM) is a row with the error. The table in
backends/splash.py (Q_BLOCKS, KV_BLOCKS, KV_COMPUTE_BLOCKS, FUSED_BACKWARD) is read from these rows.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import attnlayers
from attnlayers.backends import splash
from benchmarks import common

SHAPES = ((8, 1024, 16, 16, 128), (2, 4096, 16, 4, 128), (2, 4096, 16, 16, 128), (1, 8192, 16, 4, 128),
          (8, 1024, 12, 12, 64))  # (B, T, N, K, H): gpt2-small's heads last
CANDIDATES = ((512, False), (1024, False), (1024, True), (2048, False))  # (every block, fused backward)


def _splash(T: int, N: int, size: int, fused: bool):
  kernel = splash._kernel(T, T, N, "causal", 0, None, splash.Blocks(size, size, size, fused), False)
  def attend(q, k, v):  # q (B, T, N, H), k/v (B, T, K, H); scaled as splash.run scales
    q = (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(q.dtype)
    out = jax.vmap(kernel)(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)))  # (B, N, T, H)
    return out.transpose(0, 2, 1, 3)
  return attend


def _xla(q, k, v):
  return attnlayers.attention(q, k, v, backend="xla", is_causal=True)


def _step(attend):
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), (0, 1, 2)))


def rows(calls: int) -> list[dict]:
  out = []
  for B, T, N, K, H in SHAPES:
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, T, N, H), jnp.bfloat16)
    k, v = (jax.random.normal(x, (B, T, K, H), jnp.bfloat16) for x in (kk, kv))
    base, dq = common.time_fn(_step(_xla), q, k, v, calls=calls), _step(_xla)(q, k, v)[0].astype(jnp.float32)
    for size, fused in CANDIDATES:
      row = {"B": B, "T": T, "N": N, "K": K, "H": H, "block": size, "fused_backward": fused, "xla_ms": base.median_ms}
      try:
        step = _step(_splash(T, N, size, fused))
        t = common.time_fn(step, q, k, v, calls=calls)
        err = float(jnp.max(jnp.abs(step(q, k, v)[0].astype(jnp.float32) - dq)))
        row |= {"splash_ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms, "vs_xla": base.median_ms /
                t.median_ms, "max_dq_diff_vs_xla": err}
      except Exception as e:  # noqa: BLE001 - a block the kernel cannot compile is a row with its error
        row["error"] = common.reason(e, 160)
      out.append(row)
      print(json.dumps(row), flush=True)
  return out


def table(rows: list[dict]) -> str:
  lines = ["| B | T | N | K | H | block | fused bwd | xla ms | splash ms (p10-p90) | xla / splash | max abs dq diff |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    timing = (f"{r['splash_ms']:.2f} ({r['p10_ms']:.2f}-{r['p90_ms']:.2f}) | {r['vs_xla']:.2f} | "
              f"{r['max_dq_diff_vs_xla']:.3g}" if "error" not in r else f"{r['error']} | | ")
    lines.append(f"| {r['B']} | {r['T']} | {r['N']} | {r['K']} | {r['H']} | {r['block']} | {r['fused_backward']} "
                 f"| {r['xla_ms']:.2f} | {timing} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m benchmarks.splash_blocks", description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="runs/benchmarks",
                 help="folder for splash_blocks.json and .md (published: benchmarks/results/tpu-v5e, "
                      "written only when named here)")
  p.add_argument("--calls", type=int, default=10, help="timed calls per row")
  a = p.parse_args(argv)
  common.check_out(p, a.out)
  if jax.devices()[0].platform != "tpu":
    p.error(f"splash's kernels need a TPU; jax's device here is {jax.devices()[0].platform}")
  result = rows(a.calls)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "splash_blocks.json"), "w") as f:
    json.dump({"environment": common.environment(), "rows": result}, f, indent=1)
  text = table(result)
  with open(os.path.join(a.out, "splash_blocks.md"), "w") as f:
    f.write(f"# splash block sizes, causal fwd+bwd, bfloat16 ({common.environment()['device']})\n\n{text}\n")
  print(text)


if __name__ == "__main__":
  main()
