"""`attention()`: the functional core every layer and model in attnlayers calls."""

from __future__ import annotations

import math

from jaxtyping import Array, Bool, Float

from attnlayers import backends, spec
from attnlayers.plan import BackendUnavailableError, Plan, plan


def explain(backend: str, q, k, v, *, is_causal: bool = False, mask=None, bias=None,
            dropout_rate: float = 0.0, dropout_rng=None, broadcast_dropout: bool = True,
            precision=None, return_weights: bool = False) -> Plan:
  """Which backend would run this call (for `auto`: which it picks) and every unmet requirement.

  Takes exactly the arguments of `attention()` and validates them the same way; runs nothing.
  `str(plan)` is a readable report; `plan.chosen`, `plan.unmet`, `plan.runnable` are the facts.
  """
  dropout = spec.Dropout(dropout_rate, dropout_rng, broadcast_dropout) if dropout_rate else None
  call = spec.describe(q, k, v, is_causal=is_causal, mask=mask, bias=bias, dropout=dropout,
                       return_weights=return_weights, precision=precision)
  return plan(backend, call)


def attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    backend: str = "auto",
    is_causal: bool = False,
    mask: Bool[Array, "#B #N #T #S"] | None = None,
    bias: Float[Array, "#B #N #T #S"] | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    broadcast_dropout: bool = True,
    precision=None,
    return_weights: bool = False,
):
  """Scaled dot-product attention on the chosen kernel.

  Args:
    q: queries (B, T, N, H); k, v: keys and values (B, S, K, H) with N % K == 0
      (K == N multi-head, 1 < K < N grouped-query, K == 1 multi-query attention).
    backend: one of `attnlayers.BACKENDS` ("auto" picks the first of cudnn, xla, naive
      that can run the call; any other name runs that kernel or raises
      BackendUnavailableError listing every unmet requirement; never a silent fallback).
    is_causal: query i attends keys j <= i (top-left aligned when T != S).
    mask: boolean, broadcastable to (B, N, T, S); True = may attend. Combined with is_causal.
    bias: additive float bias on the scores, broadcastable to (B, N, T, S).
    scale: multiplies q k^T; default 1/sqrt(H).
    dropout_rate, dropout_rng, broadcast_dropout: dropout on the attention weights,
      drawn as Flax draws it (naive only).
    precision: jax.lax.Precision of naive's einsums (naive only; fused kernels accumulate
      in float32 and reject it).
    return_weights: also return the (B, N, T, S) float weights (naive only).

  Returns:
    (B, T, N, H) in q's dtype, or (out, weights) when return_weights.
  """
  chosen = explain(backend, q, k, v, is_causal=is_causal, mask=mask, bias=bias, dropout_rate=dropout_rate,
                   dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout, precision=precision,
                   return_weights=return_weights)
  if not chosen.ok:
    raise BackendUnavailableError(chosen)
  if dropout_rate and dropout_rng is None:
    raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng (a jax PRNG key)")
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  kernel = backends.REGISTRY[chosen.chosen].run
  options = dict(scale=scale, is_causal=is_causal, mask=mask, bias=bias)
  if chosen.chosen == "naive":
    dropout = spec.Dropout(dropout_rate, dropout_rng, broadcast_dropout) if dropout_rate else None
    options.update(dropout=dropout, precision=precision, return_weights=return_weights)
  return kernel(q, k, v, **options)
