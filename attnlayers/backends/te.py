"""TransformerEngine fused attention (transformer_engine.jax), registered with its requirements.

TransformerEngine is imported only inside this module and only when a kernel runs, so
attnlayers imports on machines without it. The kernel itself arrives with the
TransformerEngine work; until then every call reports it as an unmet requirement.
"""

from __future__ import annotations

from attnlayers import device as device_lib
from attnlayers.backends import _reasons
from attnlayers.spec import Call

NAME = "te"
SUMMARY = "TransformerEngine fused attention (transformer_engine.jax); GPU, fp16/bf16"
INSTALL = "pip install 'attnlayers[te]' (transformer-engine[jax], needs CUDA and a GPU to build)"


def te_requirements(call: Call, min_cc: tuple[int, int], what: str) -> list[str]:
  reasons = _reasons.nvidia_gpu(call, min_cc, what)
  if not device_lib.has_module("transformer_engine"):
    reasons.append(f"TransformerEngine is not installed: {INSTALL}")
  return reasons + _reasons.half_precision(call, what)


def unmet(call: Call) -> list[str]:
  reasons = te_requirements(call, (8, 0), "TransformerEngine fused attention")
  reasons.append("the 'te' kernel is not implemented in this version of attnlayers yet")
  return reasons + _reasons.fused_only(call, NAME)


def run(q, k, v, *, scale: float, is_causal: bool = False, mask=None, bias=None):
  raise NotImplementedError("the 'te' kernel is not implemented in this version of attnlayers yet")
