"""What a reload of the policy file did: applied, or refused with its problems.

SIGHUP, `agent.reload_on_change` and `POST /v1/reload` (`nodeagent reload`, the unit's
ExecReload=) all reload through `Agent.reload`, on the loop's thread, which returns one of
these and keeps the last: `POST /v1/reload` answers with it (its problems are the refusal's
message, so that `systemctl reload` fails with them), and `/v1/status` shows it. Plain data,
apart from the daemon, so that the routes can name it without importing the loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Reload:
    file: str
    """The policy file that was read."""
    applied: bool
    at: float
    """When it was tried (Unix time)."""
    problems: tuple[str, ...] = ()
    """Refused: each problem in one line, FILE:LINE:COL: message for the file's own, or the
    settings that only a restart applies."""
    rules: int | None = None
    tenants: int | None = None
    """Applied: the new policy's counts."""
