"""`python -m attnlayers`: which backends run on this machine, and how far each is from naive.

Runs one small causal GQA call (or the shape given by the flags) on every backend, printing
a row per backend: ok with max |difference| to naive, or every reason it cannot run.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import attnlayers
from attnlayers import backends


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m attnlayers", description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
  p.add_argument("--no-causal", dest="causal", action="store_false")
  a = p.parse_args(argv)
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (a.batch, a.seq_len, a.heads, a.head_dim)).astype(a.dtype)  # (B, T, N, H)
  k = jax.random.normal(kk, (a.batch, a.seq_len, a.kv_heads, a.head_dim)).astype(a.dtype)  # (B, S, K, H)
  v = jax.random.normal(kv, (a.batch, a.seq_len, a.kv_heads, a.head_dim)).astype(a.dtype)
  print(f"jax {jax.__version__} on {jax.devices()[0]}; q {q.shape} k/v {k.shape} {a.dtype} causal={a.causal}")
  ref = attnlayers.attention(q, k, v, backend="naive", is_causal=a.causal).astype(jnp.float32)
  for name in backends.NAMES:
    plan = attnlayers.explain(name, q, k, v, is_causal=a.causal)
    if not plan.ok:
      print(f"{name:>7}  unavailable")
      for reason in plan.unmet[name]:
        print(f"{'':>9}- {reason}")
      continue
    out = attnlayers.attention(q, k, v, backend=name, is_causal=a.causal).astype(jnp.float32)
    ran = f" (ran {plan.chosen})" if name == backends.AUTO else ""
    print(f"{name:>7}  ok{ran}  max|out - naive| = {float(jnp.abs(out - ref).max()):.3g}")


if __name__ == "__main__":
  main()
