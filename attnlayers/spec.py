"""One attention call described as the backends see it, and the checks every call passes.

Letters, as in `jax.nn.dot_product_attention`: B batch, T query length, S key/value
length, N query heads, K key/value heads (N % K == 0: K == N is MHA, 1 < K < N is GQA,
K == 1 is MQA), H head dim. q is (B, T, N, H); k and v are (B, S, K, H); a mask or bias
broadcasts to (B, N, T, S). Masks are boolean with True = may attend, for every backend.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from attnlayers import device as device_lib


@dataclasses.dataclass(frozen=True)
class Dropout:
  """Dropout on the attention weights, as Flax applies it."""
  rate: float  # probability of dropping a weight, 0 < rate < 1
  rng: object  # a jax PRNG key
  broadcast: bool = True  # one (T, S) pattern shared across batch and heads


@dataclasses.dataclass(frozen=True)
class Call:
  """Shapes, dtype and options of one call; what `unmet()` of each backend reads."""
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  dtype: np.dtype
  is_causal: bool
  mask_shape: tuple[int, ...] | None  # 4-d after left-padding with 1s
  bias_shape: tuple[int, ...] | None
  dropout: bool  # dropout on the attention weights is requested
  return_weights: bool  # the caller wants the (B, N, T, S) weights back
  precision: object  # None, or a jax.lax.Precision the caller asked for
  device: device_lib.DeviceInfo

  def shape_str(self) -> str:
    return f"B{self.B} T{self.T} S{self.S} N{self.N} K{self.K} H{self.H} {self.dtype.name}"


def _check_broadcast(name: str, x, target: tuple[int, ...], letters: str) -> tuple[int, ...]:
  if x.ndim > 4:
    raise ValueError(f"{name} must have at most 4 dims broadcastable to ({letters}) = {target}; got shape {x.shape}")
  shape = (1,) * (4 - x.ndim) + tuple(x.shape)
  bad = [f"{letter}: {got} (expected 1 or {want})" for letter, got, want in zip(letters.split(", "), shape, target) if got not in (1, want)]
  if bad:
    raise ValueError(f"{name} of shape {x.shape} does not broadcast to ({letters}) = {target}; mismatched dims " + ", ".join(bad))
  return shape


def describe(q, k, v, *, is_causal: bool = False, mask=None, bias=None, dropout: Dropout | None = None,
             return_weights: bool = False, precision=None) -> Call:
  """Validates q/k/v/mask/bias and returns the call's description; raises ValueError naming the values."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(
          f"q, k, v must be rank 4: q (B, T, N, H), k and v (B, S, K, H); {name} has shape {getattr(x, 'shape', None)}. "
          "Flatten extra batch dims into B, or use attnlayers.nnx / attnlayers.linen layers, which do.")
  B, T, N, H = q.shape
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape (B, S, K, H); got k {k.shape} and v {v.shape}")
  kB, S, K, kH = k.shape
  if kB != B:
    raise ValueError(f"q and k/v batch sizes differ: q {q.shape} has B={B}, k {k.shape} has B={kB}")
  if kH != H:
    raise ValueError(f"q and k/v head dims differ: q {q.shape} has H={H}, k {k.shape} has H={kH}")
  if K == 0 or N % K:
    raise ValueError(f"num_heads N ({N}) must be divisible by num_kv_heads K ({K}): use K = N (MHA), "
                     f"a divisor of N (GQA) or K = 1 (MQA); q {q.shape}, k {k.shape}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}. Cast them to one dtype first.")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q, k, v must be floating point; got {q.dtype}")
  target, letters = (B, N, T, S), "B, N, T, S"
  mask_shape = bias_shape = None
  if mask is not None:
    if mask.dtype != jnp.bool_:
      raise ValueError(f"mask must be boolean (True = may attend); got {mask.dtype}. Pass mask.astype(bool) if "
                       "nonzero means attend, or mask == 0 if your convention is True = masked out.")
    mask_shape = _check_broadcast("mask", mask, target, letters)
  if bias is not None:
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise ValueError(f"bias must be floating point; got {bias.dtype}")
    bias_shape = _check_broadcast("bias", bias, target, letters)
  if dropout is not None and not (0.0 < dropout.rate < 1.0):
    raise ValueError(f"dropout rate must be in (0, 1); got {dropout.rate}")
  return Call(B=B, T=T, S=S, N=N, K=K, H=H, dtype=np.dtype(q.dtype), is_causal=bool(is_causal),
              mask_shape=mask_shape, bias_shape=bias_shape, dropout=dropout is not None,
              return_weights=bool(return_weights), precision=precision, device=device_lib.current())
