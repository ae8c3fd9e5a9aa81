"""Attention written out by hand: the reference every other backend is judged by.

scores = q k^T (float32 accumulation) -> scale -> bias -> mask -> float32 softmax ->
weights (cast to the input dtype) -> dropout -> weights v; float64 q/k/v run all of it
in float64. It materialises the (B, N, T, S) weights, so it is the one backend that can
return them, apply dropout to them, or honour a matmul `precision`. Complex q/k/v give
complex64 scores (float32 parts; complex128 for complex128 q/k/v) whose softmax is
jax.nn.softmax of the complex values, as in Flax's dot_product_attention_weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnlayers.backends import _masks
from attnlayers.spec import Call

NAME = "naive"
SUMMARY = "hand-written einsum/softmax; materialises (B, N, T, S) weights; the reference"
MIN_CC = None  # runs on any device jax runs on


def unmet(call: Call) -> list[str]:
  return []  # runs anywhere jax runs


def run(q, k, v, call: Call, decision=None):
  scale, bias = call.scale, call.bias
  dropout, precision = call.dropout, call.precision
  B, T, N, H = q.shape
  _, S, K, _ = k.shape
  G = N // K  # query heads per kv head; query head n uses kv head n // G
  qg = q.reshape(B, T, K, G, H)  # (B, T, K, G, H)
  if q.dtype in (jnp.float64, jnp.complex128):  # their own precision, as Flax's weights for them
    acc = q.dtype
  else:
    acc = jnp.complex64 if jnp.iscomplexobj(q) else jnp.float32
  real = jnp.finfo(acc).dtype  # float32, or float64 for float64/complex128 q/k/v
  scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision=precision,
                      preferred_element_type=acc)  # (B, K, G, T, S)
  scores = scores.reshape(B, N, T, S) * jnp.asarray(scale, real)  # (B, N, T, S)
  if bias is not None:
    scores = scores + bias.astype(real)
  keep = _masks.allowed(call)  # lengths, causality and the mask
  if keep is not None:
    scores = jnp.where(keep, scores, jnp.finfo(real).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # (B, N, T, S)
  used = weights
  if dropout is not None:  # the same draw as Flax's attention, so results match it for one key
    keep_prob = 1.0 - dropout.rate
    shape = (1, 1, T, S) if dropout.broadcast else weights.shape
    keep_mask = jax.random.bernoulli(dropout.rng, keep_prob, shape)
    used = weights * (keep_mask.astype(q.dtype) / jnp.asarray(keep_prob, dtype=q.dtype))
  out = jnp.einsum("bkgts,bskh->btkgh", used.reshape(B, K, G, T, S), v,
                   precision=precision).reshape(B, T, N, H)  # (B, T, N, H)
  out = _masks.finish(out, call)
  return (out, weights) if call.return_weights else out
