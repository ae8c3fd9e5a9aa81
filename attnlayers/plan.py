"""Pre-flight: which backend runs a call, and every reason the others cannot."""

from __future__ import annotations

import dataclasses

from attnlayers import backends
from attnlayers.spec import Call


class BackendUnavailableError(RuntimeError):
  """The requested backend cannot run this call; `reasons` lists every unmet requirement.

  Every backend raises this (te-fp8's projections raise its subclass attnlayers.fp8.FP8Unavailable).

  Attributes:
    backend: the backend asked for ("auto" included).
    reasons: every unmet requirement, in words.
    fixes: {argument: what would work} for the reasons that one changed argument meets ("dtype" for q/k/v's
      dtype, "fp8_core" for te-fp8's core), so that a caller can name its own setting for it.
    plan: the full report where a call was planned, else None.
  """

  def __init__(self, backend: str, reasons: tuple[str, ...], message: str, plan: "Plan | None" = None):
    self.backend = backend
    self.reasons = tuple(reasons)
    self.fixes = {r.argument: r.expected for r in self.reasons if getattr(r, "argument", None)}
    self.plan = plan
    super().__init__(message)

  @classmethod
  def from_plan(cls, plan: "Plan") -> "BackendUnavailableError":
    return cls(plan.requested, tuple(r for rs in plan.unmet.values() for r in rs), str(plan), plan)


@dataclasses.dataclass(frozen=True)
class Plan:
  requested: str  # what the caller asked for ("auto" or a backend name)
  chosen: str | None  # the backend that runs, or None when nothing can
  unmet: dict[str, tuple[str, ...]]  # for each backend considered and refused: why
  runnable: tuple[str, ...]  # every registered backend that could run this call
  call: Call
  notes: tuple[str, ...] = ()  # how the chosen backend runs this call (e.g. te-fp8: FP8 or bf16 core, and why)
  decision: object = None  # the chosen backend's decide(call): how its run() runs the call (None: nothing to decide)

  @property
  def ok(self) -> bool:
    return self.chosen is not None

  def __str__(self) -> str:
    where = f"{self.call.shape_str()}, causal={self.call.is_causal} on {self.call.device.describe()}"
    lines = []
    if self.ok and self.requested == backends.AUTO:
      lines.append(f"auto chose {self.chosen!r} for {where}: the first of {', '.join(backends.AUTO_ORDER)} that can run it")
    elif self.ok:
      lines.append(f"{self.chosen!r} runs {where}")
    else:
      lines.append(f"backend {self.requested!r} cannot run {where}:")
    lines += [f"  {n}" for n in self.notes]
    for name, reasons in self.unmet.items():
      lines += [f"  - {name}: {r}" if self.requested == backends.AUTO else f"  - {r}" for r in reasons]
    if not self.ok:
      others = ", ".join(self.runnable) or "none"
      lines.append(f"backends that can run this call here: {others}")
    return "\n".join(lines)


def plan(requested: str, call: Call) -> Plan:
  """Which backend runs `call`, every reason the others cannot, and the chosen one's decisions.

  `requested` is a backend name or "auto" (the first of AUTO_ORDER that can run the call). The chosen
  backend's decide(call) is made here, once: its run() reads it and derives nothing again.
  """
  backends.check_name(requested)
  reasons = {name: tuple(b.unmet(call)) for name, b in backends.REGISTRY.items()}
  runnable = tuple(name for name, rs in reasons.items() if not rs)
  order = backends.AUTO_ORDER
  if requested == backends.AUTO:
    chosen = next((name for name in order if not reasons[name]), None)
    considered = order if chosen is None else order[:order.index(chosen)]
  else:
    chosen = None if reasons[requested] else requested
    considered = (requested,) if chosen is None else ()
  unmet = {name: reasons[name] for name in considered}
  if chosen is None:
    return Plan(requested, None, unmet, runnable, call)
  backend = backends.REGISTRY[chosen]
  decision = backend.decide(call)
  return Plan(requested, chosen, unmet, runnable, call, tuple(backend.notes(call, decision)), decision)
