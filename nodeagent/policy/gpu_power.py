"""GPU power by class: each GPU's limit is the lowest cap that applies to the classes of
the workloads holding it, in force now; a GPU no cap applies to is set back to its
default limit. Caps are clamped to the card's range; the daemon sets them through the
GPU backend and reads them back. Windows are local time and may wrap past midnight.
"""

from __future__ import annotations

from collections.abc import Sequence

from nodeagent.policy.base import POWER_LIMIT_MW, DeviceDecision, Output, Policy, PolicyInput
from nodeagent.policy.reads import Reads, Window, inside
from nodeagent.policyfile.model import PolicySpec, PowerCap


def in_force(cap: PowerCap, local_seconds: float | None) -> bool:
    if cap.start is None or cap.end is None:
        return True
    return inside((cap.start, cap.end), local_seconds)


class GpuPower(Policy):
    name = "gpu-power"
    device_settings = frozenset({POWER_LIMIT_MW})
    reads = Reads(settings=frozenset({"gpu"}), snapshot=frozenset({"gpus", "local_seconds"}))

    def windows(self, spec: PolicySpec) -> tuple[Window, ...]:
        """The caps' windows: a cap comes into force or ends at its edge."""
        return tuple(
            (c.start, c.end) for c in spec.gpu.power if c.start is not None and c.end is not None
        )

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        gpus, caps = given.snapshot.gpus, given.spec.gpu.power
        if gpus is None or not caps:
            return []
        active = [c for c in caps if in_force(c, given.snapshot.local_seconds)]
        out: list[Output] = []
        for t in gpus.telemetry:
            classes = {h.workload_class for h in gpus.holds if t.index in h.indices}
            applying = [c for c in active if str(c.workload_class) in classes]
            if applying:
                cap = min(applying, key=lambda c: c.watts)
                wanted = int(cap.watts * 1000)
                why = f"class {cap.workload_class} holds it: capped at {cap.watts:g} W"
                if cap.start is not None and cap.end is not None:
                    why += f" from {cap.start // 3600:02d}:{cap.start % 3600 // 60:02d}"
                    why += f" to {cap.end // 3600:02d}:{cap.end % 3600 // 60:02d}"
            elif t.power_default_mw is not None:
                wanted, why = t.power_default_mw, "no cap applies: the card's default"
            else:
                continue
            low, high = t.power_min_mw, t.power_max_mw
            if low is not None and high is not None:
                clamped = max(low, min(high, wanted))
                if clamped != wanted:
                    why += f" (clamped to the card's {low / 1000:g}-{high / 1000:g} W)"
                wanted = clamped
            if t.power_limit_mw != wanted:
                out.append(DeviceDecision(t.uuid, POWER_LIMIT_MW, wanted, self.name, why))
        return out
