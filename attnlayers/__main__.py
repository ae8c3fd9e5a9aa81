"""`python -m attnlayers`: which backends run on this machine, and how far each is from float64.

Runs one small causal GQA call (or the shape given by the flags) on every backend, printing
a row per backend: ok with max |difference| to a float64 numpy reference (`reference` below,
independent of every backend, naive included), or every reason it cannot run.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import attnlayers
from attnlayers import backends, device


FUSED = re.compile(r'custom_call_target="([^"]*(?:fmha|fused_attn|FusedAttn)[^"]*)"')


def inputs(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype: str):
  """Standard normal q (B, T, N, H) and k, v (B, S, K, H) with S = T, drawn from key 0."""
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (batch, seq_len, heads, head_dim)).astype(dtype)  # (B, T, N, H)
  k = jax.random.normal(kk, (batch, seq_len, kv_heads, head_dim)).astype(dtype)  # (B, S, K, H)
  v = jax.random.normal(kv, (batch, seq_len, kv_heads, head_dim)).astype(dtype)
  return q, k, v


def reference(q, k, v, causal: bool) -> np.ndarray:
  """Attention written out in float64 numpy on q (B, T, N, H), k/v (B, S, K, H); scale 1/sqrt(H).

  GQA: query head n reads kv head n // (N // K). Causal: top-left aligned, query i sees keys j <= i.
  """
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  k, v = (np.repeat(x, N // K, axis=2) for x in (k, v))  # (B, S, N, H)
  scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)  # (B, N, T, S)
  if causal:
    scores = np.where(np.tril(np.ones((T, S), dtype=bool)), scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", p, v)  # (B, T, N, H)


def fused_kernels(backend: str, q, k, v, causal: bool) -> list[str]:
  """Fused-attention custom calls in the compiled HLO of a forward+backward step."""
  def step(q, k, v):
    attend = lambda q, k, v: attnlayers.attention(q, k, v, backend=backend, is_causal=causal).astype(jnp.float32)
    return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), (0, 1, 2))(q, k, v)
  return sorted(set(FUSED.findall(jax.jit(step).lower(q, k, v).compile().as_text())))


class _Parser(argparse.ArgumentParser):
  """A bad flag is one line on stderr and exit code 2, before any work."""

  def error(self, message: str):
    print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(2)


def _count(text: str) -> int:
  """argparse type of a size flag: an int >= 1."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m attnlayers", description=" ".join(__doc__.split("\n\n")[0].split()))
  default = " (default: %(default)s)"
  p.add_argument("--batch", type=_count, default=2, help="B, rows of the call" + default)
  p.add_argument("--seq-len", type=_count, default=256, help="T = S, query and key positions per row" + default)
  p.add_argument("--heads", type=_count, default=8, help="N, query heads" + default)
  p.add_argument("--kv-heads", type=_count, default=2,
                 help="K, key/value heads; must divide --heads (K = N: MHA, 1 < K < N: GQA, K = 1: MQA)" + default)
  p.add_argument("--head-dim", type=_count, default=64, help="H, features per head" + default)
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                 help="of q, k and v" + default)
  p.add_argument("--no-causal", dest="causal", action="store_false",
                 help="every query attends every key; default: causal (query i attends keys j <= i)")
  p.add_argument("--show-kernels", action="store_true",
                 help="list the fused-attention custom calls in each backend's compiled forward and backward HLO")
  return p


def main(argv=None) -> None:
  p = parser()
  a = p.parse_args(argv)
  q = jax.ShapeDtypeStruct((a.batch, a.seq_len, a.heads, a.head_dim), a.dtype)  # (B, T, N, H)
  kv = jax.ShapeDtypeStruct((a.batch, a.seq_len, a.kv_heads, a.head_dim), a.dtype)  # (B, S, K, H)
  try:
    attnlayers.explain(backends.AUTO, q, kv, kv, is_causal=a.causal)  # the library's own checks; runs nothing
  except ValueError as e:
    p.error(f"these flags make a call attnlayers refuses (B --batch, T and S --seq-len, N --heads, K --kv-heads, "
            f"H --head-dim): {e}")
  # reference()'s peak: scores, their mask and exp (B, N, T, S); q, k and v repeated to N heads, and the output
  # (B, T, N, H); all float64. jax's own q, k, v and their float32 copies are smaller than the last four.
  need = 8 * a.batch * a.heads * a.seq_len * (3 * a.seq_len + 4 * a.head_dim)
  available = device.host_memory()
  if available is not None and need > available:
    p.error(f"the float64 reference of this call needs about {device.size(need)} of host memory (three (B, N, T, S) "
            f"and four (B, T, N, H) float64 arrays at once), and this machine has {device.size(available)} available: "
            "lower --seq-len (T = S), --batch, --heads or --head-dim")
  q, k, v = inputs(a.batch, a.seq_len, a.heads, a.kv_heads, a.head_dim, a.dtype)
  print(f"jax {jax.__version__} on {jax.devices()[0]}; q {q.shape} k/v {k.shape} {a.dtype} causal={a.causal}; "
        "reference: float64 numpy (attnlayers.__main__.reference)")
  ref = reference(q, k, v, a.causal)
  for name in backends.NAMES:
    plan = attnlayers.explain(name, q, k, v, is_causal=a.causal)
    if not plan.ok:
      print(f"{name:>7}  unavailable")
      for reason in plan.unmet[name]:
        print(f"{'':>9}- {reason}")
      continue
    try:
      out = np.asarray(attnlayers.attention(q, k, v, backend=name, is_causal=a.causal).astype(jnp.float32),
                       np.float64)
    except jax.errors.JaxRuntimeError as e:  # XLA could not compile or run this backend's call: its row says so
      if (oom := device.out_of_memory(e)) is None:
        print(f"{name:>7}  {device.xla_failure(e)}")
        continue
      naive = " (it builds the (B, N, T, S) scores)" if plan.chosen == "naive" else ""
      print(f"{name:>7}  {oom}{naive}: lower --seq-len, --batch or --heads")
      continue
    ran = f" (ran {plan.chosen})" if name == backends.AUTO else ""
    print(f"{name:>7}  ok{ran}  max|out - float64| = {float(np.abs(out - ref).max()):.3g}")
    for note in plan.notes:
      print(f"{'':>9}{note}")
    if a.show_kernels:
      print(f"{'':>9}kernels: {', '.join(fused_kernels(name, q, k, v, a.causal)) or 'none (plain XLA ops)'}")


if __name__ == "__main__":
  main()
