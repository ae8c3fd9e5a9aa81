"""TransformerEngine with FP8: FP8 projections (in the layers) and an FP8 attention core.

The core: where cuDNN's FP8 flash attention takes the call (head dim 128, T and S multiples
of 128, compute capability 9.x/10.x, no mask or bias; see _fp8_core), q/k/v are quantised to
E4M3 with per-tensor scales and the forward runs in FP8, the backward in bf16 from the FP8
forward's statistics. Where it does not, the core runs TransformerEngine's bf16 fused
attention (the `te` kernel) and `explain()` names every reason. The projections are FP8
GEMMs through TransformerEngine with its scaling recipes, in attnlayers.fp8, used by the
NNX layer when backend="te-fp8".

Requirements are read from compute capability and library versions, never GPU names.
"""

from __future__ import annotations

from attnlayers import spec
from attnlayers.backends import _fp8_core, te
from attnlayers.spec import Call

NAME = "te-fp8"
SUMMARY = "TransformerEngine FP8 GEMMs for the projections + cuDNN FP8 attention core; compute capability >= 8.9"
MIN_CC = (8, 9)  # FP8 tensor cores (Ada); the FP8 attention core itself needs 9.0


def fp8_core_unmet(call: Call) -> list[str]:
  """Why this call's core cannot run in FP8 (then it runs bf16 TE fused attention)."""
  reasons = _fp8_core.unmet(call.T, call.S, call.H, call.device.compute_capability, call.device.cudnn_version)
  if call.mask_shape is not None or call.bias_shape is not None:
    reasons.append("cuDNN FP8 attention takes no mask or bias (only causal or none)")
  return reasons


def unmet(call: Call) -> list[str]:
  reasons = te.te_requirements(call, MIN_CC, "FP8 attention")
  return reasons or te.unmet(call)  # the bf16 TE kernel must be able to run the core when FP8 cannot


def notes(call: Call) -> list[str]:
  """How a runnable call runs: FP8 core, or bf16 core and why."""
  why = fp8_core_unmet(call)
  if not why:
    return ["core: cuDNN FP8 flash attention forward (E4M3, per-tensor scales), bf16 flash backward"]
  return ["core: TransformerEngine bf16 fused attention, because " + "; ".join(why)]


def run(q, k, v, *, scale: float, is_causal: bool = False, mask=None, bias=None):
  call = spec.describe(q, k, v, is_causal=is_causal, mask=mask, bias=bias)
  if fp8_core_unmet(call):
    return te.run(q, k, v, scale=scale, is_causal=is_causal, mask=mask, bias=bias)
  return _fp8_core.attention(q, k, v, scale, is_causal)
