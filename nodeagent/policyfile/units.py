"""Human units in the policy file: sizes like 4Gi, durations like 30s, CPU in cores.

Both parsers raise only ValueError, so that pydantic turns every bad value into a
validation error with a location instead of letting, say, an OverflowError escape.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

# Digit runs are bounded so that absurd inputs fail the pattern (one clear message)
# rather than overflow a float or hit Python's int-from-string digit limit.
_NUMBER = r"(\d{1,20}(?:\.\d{1,20})?)"
_SIZE = re.compile(rf"^\s*{_NUMBER}\s*([KMGTP]i?)?B?\s*$", re.IGNORECASE)
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
# The kernel parses memory limits into a signed 64-bit page counter; anything larger is an error.
MAX_SIZE = 2**63 - 1
_DURATION = re.compile(rf"^\s*{_NUMBER}\s*(ms|s|m|h|d)?\s*$")
_DURATION_FACTORS = {"ms": 0.001, "": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as '512Mi', '4G' or '1073741824'.

    Fractions ('1.5Gi') are computed exactly and rounded down to a whole byte.
    """
    if isinstance(value, bool):
        raise ValueError("expected a size such as 4Gi, not a boolean")
    size: int | None = None
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        size = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            size = int(Fraction(m.group(1)) * _SIZE_FACTORS[(m.group(2) or "").lower()])
    if size is None:
        raise ValueError(f"expected a size such as 512Mi, 4Gi or a number of bytes, got {value!r}")
    if size > MAX_SIZE:
        raise ValueError(
            f"size {value!r} is too large: at most {MAX_SIZE} bytes (just under 8192Pi),"
            " or 'max' for no limit"
        )
    return size


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as '500ms', '30s', '5m', '1h' or '2d'."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, not a boolean")
    seconds: float | None = None
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
        if seconds < 0:
            raise ValueError("a duration cannot be negative")
    elif isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            seconds = float(m.group(1)) * _DURATION_FACTORS[m.group(2) or ""]
    if seconds is None or not math.isfinite(seconds):
        raise ValueError(f"expected a duration such as 500ms, 30s, 5m or 1h, got {value!r}")
    return seconds
