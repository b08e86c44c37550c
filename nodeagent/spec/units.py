"""Human units in the policy file: sizes like 4Gi, durations like 30s, CPU in cores."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?)?B?\s*$", re.IGNORECASE)
_SIZE_FACTORS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "p": 1000**5,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
    "pi": 1024**5,
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_FACTORS = {"ms": 0.001, "": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as '512Mi', '4G' or '1073741824'."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 4Gi, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(float(m.group(1)) * _SIZE_FACTORS[(m.group(2) or "").lower()])
    raise ValueError(f"expected a size such as 512Mi, 4Gi or a number of bytes, got {value!r}")


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as '500ms', '30s', '5m', '1h' or '2d'."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, not a boolean")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _DURATION_FACTORS[m.group(2) or ""]
    raise ValueError(f"expected a duration such as 500ms, 30s, 5m or 1h, got {value!r}")
