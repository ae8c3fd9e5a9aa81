"""TransformerEngine with FP8: FP8 projections (in the layers) and an FP8 attention core.

The core runs as `Options.fp8_core` says (spec.FP8_CORE_MODES). "fp8", the default: cuDNN's
FP8 flash attention (head dim 128, T and S multiples of 128, compute capability 9.x/10.x, no
mask or bias; see _fp8_core) with q/k/v quantised to E4M3 with per-tensor scales (from this
call's amaxes, or from `Options.fp8_amax_history`: _fp8_delayed), the forward
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

from attnlayers import device as device_lib
from attnlayers.backends import _fp8_core, _fp8_delayed, _reasons, te
from attnlayers.spec import Call, Options

NAME = "te-fp8"
SUMMARY = "TransformerEngine FP8 GEMMs for the projections + cuDNN FP8 attention core; compute capability >= 8.9"
MIN_CC = (8, 9)  # FP8 tensor cores (Ada); the FP8 attention core itself needs _fp8_core.MIN_CC
# Where FP8 pays, measured (in benchmarks/results/h200: gpt2-small/a2472b7-bias/train.md,
# gpt2-small/a2472b7-bias-repeat/train.md, gpt2-small/96cf60d-bias/train.md,
# gpt2-small/bias/train.md, gpt2-small/train.md,
# gpt2-small/steps300/train.md, gpt2-small/187a03c-train.md, gpt2-small/e29f464-train.md,
# gpt2-small/03c8adb-train.md, gpt2-small/f626088-train.md, gpt2-medium/train.md, gpt2-medium/f626088-train.md,
# gpt-1b/train.md); the plan of every call te-fp8 runs shows it (notes)
SPEED = ("speed: FP8 pays with wide GEMMs. Whole-model training on one H200, tokens/s over cudnn's in the same "
         "run: 1.012x (1.058x without biases), 1.034x (1.051x without biases), 1.028x (1.048x without biases), "
         "1.052x (1.029x without biases), 1.044x, 1.037x (300 steps), 1.027x, 0.992x, 0.9893x and 1.013x in ten "
         "runs at gpt2-small (width 768, bf16 core), 1.091x and 1.128x at gpt2-medium (1024), 1.277x at gpt-1b "
         "(2048, FP8 core); narrower models may train slower than with cudnn or te")


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


def _runs_fp8(call: Call) -> bool:
  return call.fp8_core == "fp8" or (call.fp8_core == "fp8-or-bf16" and not fp8_core_unmet(call))


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
    reasons += core
  if reasons:
    return reasons
  return [] if _runs_fp8(call) else te.unmet(call, NAME)


def notes(call: Call) -> list[str]:
  """How a runnable call runs: FP8 core, or bf16 core and why; and where FP8 pays (SPEED)."""
  if _runs_fp8(call):
    scales = "from an amax history (delayed)" if call.fp8_delayed else "from this call's amaxes (current)"
    core = f"core: cuDNN FP8 flash attention forward (E4M3, per-tensor scales {scales}), bf16 flash backward"
  elif call.fp8_core == "bf16":
    core = "core: TransformerEngine bf16 fused attention, because fp8_core='bf16'"
  else:
    core = "core: TransformerEngine bf16 fused attention (fp8_core='fp8-or-bf16'), because " + "; ".join(
        fp8_core_unmet(call))
  return [core, SPEED]


def run(q, k, v, opts: Options):
  from attnlayers import spec  # the call is described again only to pick the core
  if _runs_fp8(spec.describe(q, k, v, opts)):
    if opts.fp8_amax_history is not None:
      return _fp8_delayed.attention(q, k, v, opts.fp8_amax_history, opts.scale, opts.is_causal)
    return _fp8_core.attention(q, k, v, opts.scale, opts.is_causal)
  return te.run(q, k, v, opts)
