"""`python -m attnlayers`: which backends run on this machine, and how far each is from naive.

Runs one small causal GQA call (or the shape given by the flags) on every backend, printing
a row per backend: ok with max |difference| to naive, or every reason it cannot run.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp

import attnlayers
from attnlayers import backends


FUSED = re.compile(r'custom_call_target="([^"]*(?:fmha|fused_attn|FusedAttn)[^"]*)"')


def fused_kernels(backend: str, q, k, v, causal: bool) -> list[str]:
  """Fused-attention custom calls in the compiled HLO of a forward+backward step."""
  def step(q, k, v):
    attend = lambda q, k, v: attnlayers.attention(q, k, v, backend=backend, is_causal=causal).astype(jnp.float32)
    return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), (0, 1, 2))(q, k, v)
  return sorted(set(FUSED.findall(jax.jit(step).lower(q, k, v).compile().as_text())))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m attnlayers", description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
  p.add_argument("--no-causal", dest="causal", action="store_false")
  p.add_argument("--show-kernels", action="store_true",
                 help="list the fused-attention custom calls in each backend's compiled forward and backward HLO")
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
    for note in plan.notes:
      print(f"{'':>9}{note}")
    if a.show_kernels:
      print(f"{'':>9}kernels: {', '.join(fused_kernels(name, q, k, v, a.causal)) or 'none (plain XLA ops)'}")


if __name__ == "__main__":
  main()
