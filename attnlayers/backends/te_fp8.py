"""TransformerEngine with FP8 (compute capability >= 8.9), registered with its requirements.

Like `te`, TransformerEngine is imported only here, lazily. The FP8 kernel arrives with
the TransformerEngine work; until then every call reports it as an unmet requirement.
"""

from __future__ import annotations

from attnlayers.backends import _reasons
from attnlayers.backends.te import te_requirements
from attnlayers.spec import Call

NAME = "te-fp8"
SUMMARY = "TransformerEngine FP8 projections + cuDNN FP8 attention core; compute capability >= 8.9"


def unmet(call: Call) -> list[str]:
  reasons = te_requirements(call, (8, 9), "FP8 attention")
  reasons.append("the 'te-fp8' kernel is not implemented in this version of attnlayers yet")
  return reasons + _reasons.fused_only(call, NAME)


def run(q, k, v, *, scale: float, is_causal: bool = False, mask=None, bias=None):
  raise NotImplementedError("the 'te-fp8' kernel is not implemented in this version of attnlayers yet")
