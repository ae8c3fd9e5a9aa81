"""TransformerEngine with FP8: FP8 projections (in the layers) and an FP8 attention core.

The core runs as the call's `fp8_core` says (spec.FP8_CORE_MODES). "fp8", the default: cuDNN's
FP8 flash attention (head dim 128, T and S multiples of 128, compute capability 9.x/10.x, no
mask or bias; see _fp8_core) with q/k/v quantised to E4M3 with per-tensor scales (from this
call's amaxes, or from the call's `fp8_amax_history`: _fp8_delayed), the forward
in FP8 and the backward in bf16 from the FP8 forward's statistics; a call it cannot take is
refused with every reason, never run another way. "fp8-or-bf16": the same where the call
qualifies, else TransformerEngine's bf16 fused attention (the `te` kernel), and explain()
names which and why. "bf16": always the `te` kernel. The projections are FP8 GEMMs through
TransformerEngine with its scaling recipes, in attnlayers.fp8, used by the NNX layer.

Every requirement of te-fp8 is checked here (`requirements`), by unmet() for the core and by
attnlayers.fp8 for the projections. Requirements are read from compute capability and
library versions, never GPU names.
"""

from __future__ import annotations

import dataclasses

from attnlayers import device as device_lib
from attnlayers.backends import _fp8_core, _fp8_delayed, _reasons, te
from attnlayers.spec import Call

NAME = "te-fp8"
SUMMARY = "TransformerEngine FP8 GEMMs for the projections + cuDNN FP8 attention core; compute capability >= 8.9"
MIN_CC = (8, 9)  # FP8 tensor cores (Ada); the FP8 attention core itself needs _fp8_core.MIN_CC


def requirements(dev: device_lib.DeviceInfo, what: str = "te-fp8 (FP8 GEMMs)") -> list[str]:
  """What te-fp8 needs of the machine at all (FP8 tensor cores, TransformerEngine); `what` names the part asking."""
  return _reasons.nvidia_gpu(dev, MIN_CC, what) + _reasons.transformer_engine("te-fp8")


def fp8_core_unmet(call: Call, *, device: bool = True, precision: bool = True) -> list[str]:
  """Why cuDNN's FP8 attention cannot take this call's core (device=False: the call's own limits only;
  precision=False: not its precision, which te-fp8 has refused for either core)."""
  reasons = _fp8_core.unmet(call.T, call.S, call.H, call.device.compute_capability, call.device.cudnn_version,
                            device=device)
  if call.mask_shape is not None or call.bias_shape is not None:
    reasons.append("cuDNN FP8 attention takes no mask or bias (only causal or none)")
  if call.has_lengths or call.bottom_right:
    reasons.append("cuDNN FP8 attention takes no per-row lengths or bottom-right causal mask (decode-shaped calls); "
                   "fp8_core='fp8-or-bf16' runs those on TransformerEngine's bf16 kernel")
  reasons += _reasons.no_segments_or_window(call, "cuDNN FP8 attention", others="fp8_core='fp8-or-bf16' runs them "
                                            "on TransformerEngine's bf16 kernel (as backend='te' does)")
  if precision and not _reasons.is_default_precision(call.precision):
    reasons.append(f"the FP8 core quantises q, k, v and P to E4M3, so it cannot apply precision={call.precision}")
  return reasons


@dataclasses.dataclass(frozen=True)
class Decision:
  """Which attention core runs a call, and how."""
  core: str  # "fp8": cuDNN's FP8 flash attention; "bf16": TransformerEngine's bf16 fused attention
  delayed: bool  # the FP8 core scales q, k, v from the call's amax history (else from this call's amaxes)
  te: te.Decision | None = None  # the bf16 core's settings
  why_bf16: tuple[str, ...] = ()  # fp8_core="fp8-or-bf16" on the bf16 core: why the FP8 core cannot take the call


def decide(call: Call) -> Decision:
  """The FP8 core for fp8_core="fp8", and for "fp8-or-bf16" where it can take the call; else the bf16 core."""
  why = () if call.fp8_core != "fp8-or-bf16" else tuple(fp8_core_unmet(call))
  if call.fp8_core == "fp8" or (call.fp8_core == "fp8-or-bf16" and not why):
    return Decision("fp8", delayed=call.fp8_delayed)
  return Decision("bf16", delayed=False, te=te.decide(call), why_bf16=why)


def unmet(call: Call) -> list[str]:
  device = requirements(call.device, NAME)
  precision = _reasons.fused_precision(call, NAME, exact_half_products=True)  # either core
  reasons = device + _reasons.half_precision(call, "te-fp8") + _reasons.no_weights_or_dropout(call, NAME) + precision
  # the FP8 core's reasons belong in the list too; where te-fp8's device requirements fail, or it refused the
  # precision for either core, the core's own reasons would only repeat them, so then it leaves those out
  if call.fp8_core == "fp8" and (why := fp8_core_unmet(call, device=not device, precision=not precision)):
    core = [f"te-fp8's FP8 attention core (fp8_core='fp8') cannot take this call: {r}" for r in why]
    if "fp8-or-bf16" not in core[-1]:  # the segments/window/lengths reasons name it themselves
      core[-1] += "; pass fp8_core='fp8-or-bf16' to run TransformerEngine's bf16 core for such calls, or use " \
                  "backend='te'"
    reasons += [_reasons.Reason(r, "fp8_core", "fp8-or-bf16") for r in core]
  if reasons:
    return reasons
  return [] if decide(call).core == "fp8" else te.unmet(call, NAME)


def notes(call: Call, decision: Decision) -> list[str]:
  """How a runnable call runs: the FP8 core, or the bf16 core and why."""
  if decision.core == "fp8":
    scales = "from an amax history (delayed)" if decision.delayed else "from this call's amaxes (current)"
    return [f"core: cuDNN FP8 flash attention forward (E4M3, per-tensor scales {scales}), bf16 flash backward"]
  if call.fp8_core == "bf16":
    return ["core: TransformerEngine bf16 fused attention, because fp8_core='bf16'"]
  return ["core: TransformerEngine bf16 fused attention (fp8_core='fp8-or-bf16'), because " +
          "; ".join(decision.why_bf16)]


def run(q, k, v, call: Call, decision: Decision):
  if decision.core == "bf16":
    return te.run(q, k, v, call, decision.te)
  if decision.delayed:
    return _fp8_delayed.attention(q, k, v, call.fp8_amax_history, call.scale, call.is_causal)
  return _fp8_core.attention(q, k, v, call.scale, call.is_causal)
