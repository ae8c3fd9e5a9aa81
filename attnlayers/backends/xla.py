"""XLA's own attention: `jax.nn.dot_product_attention(implementation="xla")`.

Runs on every platform and dtype; on a GPU, XLA fuses what it can but still builds
the (B, N, T, S) scores in memory.
"""

from __future__ import annotations

import jax

from attnlayers.backends import _reasons
from attnlayers.spec import Call

NAME = "xla"
SUMMARY = "jax.nn.dot_product_attention(implementation='xla'); any platform, any float dtype"


def unmet(call: Call) -> list[str]:
  return _reasons.fused_only(call, NAME)


def run(q, k, v, *, scale: float, is_causal: bool = False, mask=None, bias=None):
  return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                      is_causal=is_causal, implementation="xla")
