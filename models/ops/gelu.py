"""GPT-2's GELU (the tanh approximation), computed as x * sigmoid in float32, with a backward
that keeps only its input.

Why: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = c (x + 0.044715 x^3), c = sqrt(2 / pi), the same
function. On the GPU, XLA's float32 tanh is a rational approximation with a division; exp and
one division cost less, and the MLP's GELU passes over (B, T, 4D) arrays are about as much
arithmetic as memory traffic.

The backward saves x alone and recomputes the sigmoid (arithmetic instead of memory traffic):
differentiating jax.nn.gelu would keep intermediates of the forward, each a (B, T, 4D) array.
Both directions compute in float32 and round once to x's dtype. Float32 values agree with
jax.nn.gelu(approximate=True) within 5e-6 absolute; for negative x, where jax's 1 + tanh(u) cancels,
these are the more accurate (at x = -5 jax gives -0, this -2.29e-7, the formula's value).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

_C = math.sqrt(2 / math.pi)  # u = C (x + A x^3); gelu = 0.5 x (1 + tanh(u)) = x sigmoid(2u)
_A = 0.044715


def value(xf: Float[Array, "..."]) -> Float[Array, "..."]:
  """gelu at float32 xf, float32: x * sigmoid(2u)."""
  return xf * _sigmoid_2u(xf)


def _sigmoid_2u(xf: Float[Array, "..."]) -> Float[Array, "..."]:
  """sigmoid(2u) = 1 / (1 + exp(-2u)), float32; exp overflowing to inf for very negative x gives 0, not NaN."""
  return 1 / (1 + jnp.exp(-2 * _C * (xf + _A * xf * xf * xf)))


@jax.custom_vjp
def gelu(x: Float[Array, "..."]) -> Float[Array, "..."]:
  """GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in x's dtype; its
  gradient recomputes from x."""
  return value(x.astype(jnp.float32)).astype(x.dtype)


def _gelu_fwd(x):
  return gelu(x), x


def derivative(xf: Float[Array, "..."]) -> Float[Array, "..."]:
  """d gelu / dx at float32 xf, float32: s + x s (1 - s) 2c (1 + 3a x^2) with s = sigmoid(2u) (tanh' = 4 s (1 - s))."""
  s = _sigmoid_2u(xf)
  return s + xf * s * (1 - s) * (2 * _C) * (1 + 3 * _A * xf * xf)


def _gelu_bwd(x, g):
  return ((g.astype(jnp.float32) * derivative(x.astype(jnp.float32))).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
