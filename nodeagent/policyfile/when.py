"""Points in time and CPU amounts relative to the node, as operators write them.

Deadlines are absolute ISO 8601 times ("2026-12-01T18:00:00Z") in the policy file, where
a time without an offset would depend on the daemon's time zone and is refused; on the
command line (`nodeagent exec --deadline`) they may also be relative ("+90s", "+2h") or
naive (local time, as the operator reads the clock). CPU reservations are cores ("1.5")
or a share of the node's CPUs ("20%").
"""

from __future__ import annotations

import datetime as dt
import math
import re

from nodeagent.policyfile.units import parse_duration

_RELATIVE = re.compile(r"^\s*\+\s*(.+)$")
_PERCENT = re.compile(r"^\s*(\d{1,3}(?:\.\d{1,6})?)\s*%\s*$")


def parse_instant(
    value: object, *, now: float | None = None, naive_is_local: bool = False
) -> float:
    """Unix seconds from an ISO 8601 time (a datetime from YAML too), or '+DURATION' from
    `now` when `now` is given. Raises ValueError with a message an operator can act on."""
    if isinstance(value, bool):
        raise ValueError("expected a time such as 2026-12-01T18:00:00Z, not a boolean")
    if isinstance(value, str):
        m = _RELATIVE.match(value)
        if m is not None:
            if now is None:
                raise ValueError(
                    f"a relative time ({value!r}) is only allowed on the command line;"
                    " write an ISO 8601 time such as 2026-12-01T18:00:00Z"
                )
            return now + parse_duration(m.group(1))
        text = value.strip()
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            raise ValueError(f"expected a time of day too, such as {text}T18:00:00Z")
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            value = dt.datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(
                "expected an ISO 8601 time such as 2026-12-01T18:00:00Z"
                + (" or a relative one such as +90s or +2h" if now is not None else "")
                + f", got {value!r}"
            ) from None
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        raise ValueError(f"expected a time of day too, such as {value.isoformat()}T18:00:00Z")
    if not isinstance(value, dt.datetime):
        raise ValueError(f"expected a time such as 2026-12-01T18:00:00Z, got {value!r}")
    if value.tzinfo is None:
        if not naive_is_local:
            raise ValueError(f"{value.isoformat()} has no UTC offset; add one, such as Z or +01:00")
        value = value.astimezone()  # local time, as the operator reads the clock
    seconds = value.timestamp()
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a usable time")
    return seconds


def parse_cpu_amount(value: object) -> tuple[float, bool]:
    """(amount, is_fraction): cores such as 1.5, or a share of the node's CPUs such as '20%'."""
    if isinstance(value, bool):
        raise ValueError("expected cores such as 1.5 or a share such as 20%, not a boolean")
    if isinstance(value, str):
        m = _PERCENT.match(value)
        if m is not None:
            share = float(m.group(1)) / 100
            if not 0 <= share <= 1:
                raise ValueError(f"a share of the node's CPUs is 0% to 100%, got {value!r}")
            return share, True
    cores = math.nan
    if isinstance(value, int | float | str):
        try:
            cores = float(value)
        except (ValueError, OverflowError):
            cores = math.nan
    if not 0 <= cores < 1e6:
        raise ValueError(f"expected cores such as 1.5 or a share such as 20%, got {value!r}")
    return cores, False
