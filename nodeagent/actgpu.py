"""Apply a plan to the GPUs: the power limits its decisions say, set through the backend.

The executor's GPU side, beside `act.py`'s cgroup writes and in its layer: the loop calls
it after each tick's plan with that tick's snapshot, whose GPU telemetry says which limits
are in force already. Every change is an audit event (`gpu.power_limit`: the GPU, the old
limit, the one the card applied and the one asked for, the decision's reason); a failure
is logged once (`gpu.power_failed`), again only when it changes or comes back after a
success, and tried again every tick.
"""

from __future__ import annotations

import structlog

from nodeagent.errors import NodeagentError, one_line
from nodeagent.gpu.backend import GpuBackend
from nodeagent.logs import audit_event
from nodeagent.policy.base import POWER_LIMIT_MW
from nodeagent.policy.plan import Plan
from nodeagent.snapshot import NodeSnapshot

log = structlog.get_logger("nodeagent.gpu")


class GpuExecutor:
    """Sets the GPUs' power limits from the plans' decisions, through one backend for the
    daemon's life; remembers each GPU's last failure, to log it once."""

    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self._failed: dict[str, str] = {}

    def apply(self, plan: Plan, snapshot: NodeSnapshot, dry_run: bool) -> None:
        """Set the power limits the plan wants, read them back, audit each change; a dry
        run sets nothing. A plan made again on an unchanged key still holds last tick's
        decisions: a limit the snapshot's telemetry shows in force already is not set
        again."""
        gpus = snapshot.gpus
        current = {t.uuid: t.power_limit_mw for t in (gpus.telemetry if gpus else ())}
        for d in plan.devices:
            if d.setting != POWER_LIMIT_MW or dry_run or current.get(d.uuid) == d.value:
                continue
            try:
                result = self.backend.set_power_limit(d.uuid, d.value)
            except NodeagentError as e:
                if self._failed.get(d.uuid) != str(e):
                    log.warning(
                        "gpu.power_failed", gpu=d.uuid, target_mw=d.value, error=one_line(e)
                    )
                    self._failed[d.uuid] = str(e)
                continue
            self._failed.pop(d.uuid, None)
            audit_event(
                "gpu.power_limit",
                gpu=d.uuid,
                old_mw=current.get(d.uuid),
                new_mw=result.applied_mw,
                requested_mw=d.value,
                reason=d.reason,
                simulated=result.simulated,
            )
