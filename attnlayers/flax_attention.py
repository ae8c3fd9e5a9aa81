"""`BackendAttention`: a Flax `attention_fn` that runs attnlayers' core on a chosen backend.

Flax's attention layers (nnx and linen) call `attention_fn(query, key, value, mask=...,
dropout_rng=..., module=..., ...)` with `[batch..., length, heads, head_dim]` arrays and
Flax-style masks (any dtype, nonzero = attend). This adapter is the one place that maps
that convention onto `attnlayers.attention`: it flattens extra batch dims, turns the mask
to bool, and asks for the weights only when Flax wants to sow them or drop them out. Both
attnlayers.nnx and attnlayers.linen use it; it also works as `attention_fn=` of Flax's own
classes.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from attnlayers import backends
from attnlayers.core import attention


def _flatten_batch(x, batch: tuple[int, ...]):
  """(*batch, A, B, C) -> (prod(batch), A, B, C); a no-op for one batch dim."""
  return x.reshape((math.prod(batch), *x.shape[-3:]))


def _mask_4d(x, batch: tuple[int, ...]):
  """A mask/bias broadcastable to (*batch, N, T, S) -> one broadcastable to (B, N, T, S)."""
  x = x.reshape((1,) * (len(batch) + 3 - x.ndim) + x.shape)  # (*batch or 1s, N|1, T|1, S|1)
  if len(batch) == 1:
    return x
  return _flatten_batch(jnp.broadcast_to(x, batch + x.shape[-3:]), batch)


def _sow(module, weights) -> None:
  if isinstance(module, nnx.Module):
    module.sow(nnx.Intermediate, "attention_weights", weights)
  else:  # linen
    module.sow("intermediates", "attention_weights", weights)


@dataclasses.dataclass(frozen=True)
class BackendAttention:
  """attention_fn for Flax layers; `backend` is any name in attnlayers.BACKENDS."""
  backend: str = backends.AUTO

  def __post_init__(self):
    backends.check_name(self.backend)

  def __call__(self, query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
               dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False, dtype=None,
               precision=None, module=None, is_causal: bool = False, force_fp32_for_softmax: bool = False):
    # Softmax is float32 in every backend, so force_fp32_for_softmax always holds.
    dtype = dtype or jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    batch = query.shape[:-3]  # (batch...)
    q, k, v = (_flatten_batch(x, batch) for x in (query, key, value))  # (B, T, N, H), (B, S, K, H)
    if mask is not None:
      mask = _mask_4d(mask, batch).astype(jnp.bool_)  # Flax masks: nonzero = may attend
    if bias is not None:
      bias = _mask_4d(bias, batch)
    dropping = dropout_rate > 0.0 and not deterministic
    wants_weights = module is not None or dropping
    result = attention(
        q, k, v, backend=self.backend, is_causal=is_causal, mask=mask, bias=bias,
        dropout_rate=dropout_rate if dropping else 0.0, dropout_rng=dropout_rng if dropping else None,
        broadcast_dropout=broadcast_dropout, precision=precision if wants_weights else None,
        return_weights=module is not None)
    out, weights = result if module is not None else (result, None)
    if module is not None:
      _sow(module, weights.reshape(batch + weights.shape[1:]))  # (batch..., N, T, S)
    return out.reshape(query.shape[:-1] + value.shape[-1:])  # (batch..., T, N, H)
