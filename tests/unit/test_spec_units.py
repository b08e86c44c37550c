"""Units in the policy file: sizes and durations, and the errors for values that are not."""

from __future__ import annotations

import contextlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.policyfile.units import MAX_SIZE, parse_duration, parse_size

KI, MI, GI, TI = 1024, 1024**2, 1024**3, 1024**4


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("512Mi", 512 * MI),
        ("4Gi", 4 * GI),
        ("4gi", 4 * GI),
        ("4GiB", 4 * GI),
        ("1Ki", KI),
        ("2Ti", 2 * TI),
        ("1Pi", 1024**5),
        ("4G", 4 * 10**9),
        ("4K", 4000),
        ("3M", 3 * 10**6),
        ("1T", 10**12),
        ("1.5Gi", 3 * GI // 2),
        ("0.1Ki", 102),  # rounded down to a whole byte
        (" 2 Mi ", 2 * MI),
        ("100B", 100),
        ("9Pi", 9 * 1024**5),
        (MAX_SIZE, MAX_SIZE),
    ],
)
def test_parse_size(value: object, size: int) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "expected a size such as 4Gi, not a boolean"),
        (-1, "a size cannot be negative"),
        ("lots", "expected a size such as 512Mi, 4Gi or a number of bytes, got 'lots'"),
        ("-1Mi", "got '-1Mi'"),
        ("1.5.5", "got '1.5.5'"),
        ("4Xi", "got '4Xi'"),
        ("", "got ''"),
        (1.5, "got 1.5"),
        (None, "got None"),
        ("9" * 30, "got '999"),
        (MAX_SIZE + 1, "is too large"),
        ("99999999Pi", "is too large"),
    ],
)
def test_parse_size_rejects(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_size(value)


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["", "K", "Ki", "M", "Mi", "G", "Gi"]),
)
def test_parse_size_scales_exactly(n: int, unit: str) -> None:
    factor = {"": 1, "K": 1000, "Ki": KI, "M": 10**6, "Mi": MI, "G": 10**9, "Gi": GI}[unit]
    assert parse_size(f"{n}{unit}") == n * factor


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (1, 1.0),
        (0.5, 0.5),
        ("30", 30.0),
        ("1.5", 1.5),
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("2d", 172800.0),
        (" 10 s ", 10.0),
    ],
)
def test_parse_duration(value: object, seconds: float) -> None:
    result = parse_duration(value)
    assert isinstance(result, float)
    assert result == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "expected a duration such as 30s, not a boolean"),
        (-1, "a duration cannot be negative"),
        (-0.5, "a duration cannot be negative"),
        ("30x", "expected a duration such as 500ms, 30s, 5m or 1h, got '30x'"),
        ("30S", "got '30S'"),  # units are lower case, as in Go and systemd
        ("-5s", "got '-5s'"),
        ("1h30m", "got '1h30m'"),
        ("", "got ''"),
        (None, "got None"),
        (float("inf"), "got inf"),
        (float("nan"), "got nan"),
        (10**400, "got 1000"),
        ("9" * 30, "got '999"),
    ],
)
def test_parse_duration_rejects(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_duration(value)


ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.floats(),
    st.text(),
    st.from_regex(r"\d{1,400}(\.\d{1,400})?(Pi|ms|d)?", fullmatch=True),
    st.binary(),
)


@given(ODD_VALUES)
def test_parsers_raise_only_value_error(value: object) -> None:
    """pydantic turns ValueError into a located problem; anything else would be a traceback."""
    for parse in (parse_size, parse_duration):
        with contextlib.suppress(ValueError):
            parse(value)
