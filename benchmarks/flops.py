"""FLOP counts behind every benchmark rate: one convention, stated once, checked against XLA.

Per-call rates (benchmarks.layer, .fp8, .wrapper) count the FLOPs the math needs:
  attention forward    4·B·N·T·S·H (Q·Kᵀ and P·V), halved when causal: the lower triangle;
                       packed documents and sliding windows: only the pairs they leave unmasked
                       (attention_segments, attention_window);
  attention backward   twice the forward (dP, dQ, dK, dV: four products); the Q·Kᵀ that flash
                       kernels recompute in their backward is not counted;
  projection           2·M·K·N forward, twice that backward (dX and dW).
Every backend executes at least that (XLA's attention computes the full T x S square and
masks it; flash kernels recompute the scores), so a rate is a lower bound of the rate the
hardware ran at, never above it. Training MFU (models.flops_per_token) keeps
nanoGPT's / PaLM's definition instead: 6·N + 12·L·n_head·head_dim·T per token, the full
square even for causal attention; its columns say so.

`compiled_dot_flops` counts the dot FLOPs of a compiled XLA program from its HLO text, so
tests can check each benchmark program's formula against what XLA kept (XLA deletes work
whose result nobody uses). `check_rate` refuses a rate above the device's dense peak.
"""

from __future__ import annotations

import math
import re

import jax

PASSES = ("fwd", "bwd", "fwd+bwd")
_BWD_FACTOR = {"fwd": 1.0, "bwd": 2.0, "fwd+bwd": 3.0}  # backward = twice the forward, for attention and matmuls


class ImpossibleRate(RuntimeError):
  """A measured rate above the device's dense peak: the FLOP count or the timing is wrong."""


def attention(B: int, T: int, S: int, N: int, H: int, *, causal: bool, pass_: str) -> float:
  """FLOPs of one attention core call (q (B, T, N, H), k/v (B, S, K, H); K does not change them)."""
  fwd = 4.0 * B * N * T * S * H * (0.5 if causal else 1.0)
  return fwd * _BWD_FACTOR[pass_]


def attention_segments(B: int, T: int, N: int, H: int, *, documents: int, causal: bool, pass_: str) -> float:
  """FLOPs of self-attention over rows of T tokens packed with `documents` equal-length documents.

  Segment ids leave each query only the keys of its own document, so the math needs
  documents × attention(length T / documents): only the unmasked pairs, as the convention above
  counts them (each causal document's lower triangle as half its square). documents=1 is
  attention(B, T, T, ...).
  """
  if documents < 1 or T % documents:
    raise ValueError(f"documents ({documents}) must be >= 1 and divide T ({T}): equal-length documents")
  L = T // documents
  return documents * attention(B, L, L, N, H, causal=causal, pass_=pass_)


def window_pairs(T: int, left: int) -> int:
  """(query, key) pairs of causal self-attention of length T with window=(left, 0): query t attends
  keys max(0, t - left) ... t, min(t + 1, left + 1) of them; summed over t."""
  if left < 0:
    raise ValueError(f"left ({left}) must be >= 0")
  w = min(left + 1, T)  # keys of a query that has a full window
  return w * (w + 1) // 2 + (T - w) * w  # queries t < w attend t + 1 keys, the rest w


def attention_window(B: int, T: int, N: int, H: int, *, left: int, pass_: str) -> float:
  """FLOPs of causal self-attention with a sliding window, window=(left, 0) and is_causal=True.

  Counts only the in-window causal pairs, as the convention above counts only unmasked pairs:
  4·B·N·H·window_pairs(T, left) forward. The pairs are counted exactly, diagonal included, so a
  window that covers the whole row (left >= T - 1) gives T (T + 1) / 2 pairs, T / 2 more than
  attention(causal=True), whose T² / 2 halves the square (a relative 1 / T: 0.006% at T = 16384).
  """
  return 4.0 * B * N * H * window_pairs(T, left) * _BWD_FACTOR[pass_]


def attention_full_square(B: int, T: int, S: int, N: int, H: int, *, pass_: str) -> float:
  """FLOPs XLA's unfused attention executes: the full square, masked or not."""
  return attention(B, T, S, N, H, causal=False, pass_=pass_)


def matmul(M: int, K: int, N: int, *, pass_: str) -> float:
  """FLOPs of an (M, K) x (K, N) product, forward 2·M·K·N."""
  return 2.0 * M * K * N * _BWD_FACTOR[pass_]


def projections(B: int, T: int, D: int, N: int, K: int, H: int, *, pass_: str) -> float:
  """The four projections of an attention layer: q (D -> N·H), k and v (D -> K·H), out (N·H -> D)."""
  return matmul(B * T, D, (2 * N + 2 * K) * H, pass_=pass_)


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*([a-z0-9]+)\[([\d,]*)\]")
_DOT = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*[a-z0-9]+\[([\d,]*)\]\S*\s+dot\(%([\w.\-]+),.*?"
                  r"lhs_contracting_dims=\{([\d,]*)\}")
_OTHER_PRODUCTS = re.compile(r"\b(convolution|custom-call)\(")


def _dims(text: str) -> tuple[int, ...]:
  return tuple(int(d) for d in text.split(",") if d)


def compiled_dot_flops(fn, *args) -> float:
  """2·(output elements)·(contracted size), summed over every dot of fn's compiled program.

  Compiled for the CPU, also on a GPU machine: XLA's CPU backend keeps attention and
  projections as plain dots (a GPU build turns them into cuBLAS custom calls). Raises where the
  program holds a convolution or custom call, whose FLOPs this does not read.
  """
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    text = jax.jit(fn).lower(*jax.device_put(args, cpu)).compile().as_text()
  shapes = {m.group(1): _dims(m.group(3)) for line in text.splitlines() if (m := _INSTR.match(line))}
  total = 0.0
  for line in text.splitlines():
    if _OTHER_PRODUCTS.search(line) and "dot(" not in line:
      raise ValueError(f"compiled program has an op whose FLOPs are not counted here: {line.strip()[:200]}")
    if (m := _DOT.match(line)):
      out, lhs, contracting = _dims(m.group(1)), shapes[m.group(2)], _dims(m.group(3))
      total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)
  return total


def check_rate(name: str, flops: float, seconds: float, peak_flops: float | None, peak_name: str) -> float:
  """FLOP/s of a measured program; raises ImpossibleRate when it is above the device's dense peak."""
  rate = flops / seconds
  if peak_flops and rate > peak_flops:
    raise ImpossibleRate(f"{name}: {rate / 1e12:.1f} TFLOP/s is above the device's {peak_name} dense peak of "
                         f"{peak_flops / 1e12:.0f} TFLOP/s; the FLOP count or the timing of this program is wrong")
  return rate
