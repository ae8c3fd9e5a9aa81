"""The shared numerics matrix: MHA/GQA/MQA x causal x mask x dtype, checked against tests/reference.py.

Also the float64 reference of a whole attention layer, computed from the layer's own
projections (`layer_reference`), so every layer backend is judged by the same yardstick.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlayers
from attnlayers.device import has_module
from tests import reference

HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}  # name -> (N, K)


def matrix(dtypes):
  """pytest params: (heads, causal, masked, dtype) with readable ids like 'GQA-causal-mask-bfloat16'."""
  rows = itertools.product(HEADS, (False, True), (False, True), dtypes)
  return [dict(heads=h, causal=c, masked=m, dtype=d) for h, c, m, d in rows]


def case_id(case: dict) -> str:
  return "-".join([case["heads"], "causal" if case["causal"] else "full", "mask" if case["masked"] else "nomask",
                   np.dtype(case["dtype"]).name])


def inputs(case: dict, *, B=2, T=16, S=16, H=16, seed=0):
  """q (B, T, N, H), k/v (B, S, K, H), dout (B, T, N, H), mask (B, 1, T, S) or None."""
  N, K = HEADS[case["heads"]]
  kq, kk, kv, kd, km = jax.random.split(jax.random.key(seed), 5)
  dtype = case["dtype"]
  q = jax.random.normal(kq, (B, T, N, H)).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, H)).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, H)).astype(dtype)
  dout = jax.random.normal(kd, (B, T, N, H)).astype(jnp.float32)
  mask = None
  if case["masked"]:
    mask = jax.random.bernoulli(km, 0.7, (B, 1, T, S)).at[..., 0].set(True)  # no row fully masked
  return q, k, v, dout, mask


def head_bias(case: dict, *, B=2, T=16, S=16, seed=0):
  """An additive bias (1, N, T, S) in the inputs' dtype: standard normal, different for every head.

  Of the scale of the scores themselves (q.k/sqrt(H) is standard normal here), so a backend
  that drops it, or adds it to the wrong head, is off by O(1).
  """
  N, _ = HEADS[case["heads"]]
  return jax.random.normal(jax.random.key(seed + 1000), (1, N, T, S)).astype(case["dtype"])


def check(backend: str, case: dict, tolerance=None, *, scale=None, bias=None, **shape):
  """Outputs and q/k/v gradients of `backend` against the float64 reference.

  tolerance: the key of tests/reference.py's tolerances; default the inputs' dtype ("fp8" for FP8).
  scale, bias: passed to the backend and the reference alike (default 1/sqrt(H), none).
  """
  q, k, v, dout, mask = inputs(case, **shape)
  causal, dtype = case["causal"], case["dtype"]
  tol = dtype if tolerance is None else tolerance

  def loss(q, k, v):
    out = attnlayers.attention(q, k, v, backend=backend, is_causal=causal, mask=mask, bias=bias, scale=scale)
    return jnp.sum(out.astype(jnp.float32) * dout), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  assert out.dtype == q.dtype and out.shape == q.shape
  f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  m = None if mask is None else np.asarray(mask)
  options = dict(mask=m, is_causal=causal, scale=scale, bias=None if bias is None else f64(bias))
  want, _ = reference.forward(f64(q), f64(k), f64(v), **options)
  reference.assert_close(out, want, tol, "out", f"{backend} output")
  want_grads = reference.gradients(f64(q), f64(k), f64(v), np.asarray(dout), **options)
  for name, got, ref in zip("qkv", grads, want_grads):
    assert got.dtype == q.dtype
    reference.assert_close(got, ref, tol, "grad", f"{backend} d{name}")


def layer_reference(layer, x, *, mask=None, is_causal=False):
  """Float64 output of an nnx.MultiHeadAttention (ours or Flax's) for self-attention on x (B, T, D).

  q, k, v are the layer's own projections, as the layer computes them (in its dtype); the
  attention and the output projection then run in float64 from them and the layer's
  parameters. mask: Flax-style, nonzero = may attend, broadcastable to (B, N, T, S).
  """
  assert not layer.normalize_qk, "layer_reference applies no query_ln/key_ln"
  f64 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
  q, k, v = (f64(proj(x)) for proj in (layer.query, layer.key, layer.value))  # (B, T, N|K, H)
  m = None if mask is None else f64(mask) != 0
  o, _ = reference.forward(q, k, v, mask=m, is_causal=is_causal)  # (B, T, N, H)
  out = np.einsum("btnh,nhd->btd", o, f64(layer.out.kernel[...]))  # (B, T, D)
  return out if layer.out.bias is None else out + f64(layer.out.bias[...])

# GPU tests that also need TransformerEngine (with pytest.mark.gpu, which skips them off a GPU)
needs_te = pytest.mark.skipif(not has_module("transformer_engine"),
                              reason="needs an NVIDIA GPU with TransformerEngine (pip install 'attnlayers[te]' there)")
