"""Shell globs for `match.path` and `match.name`, compiled in linear time to a safe regex.

The meaning is fnmatch's (`*` also crosses `/`, `?`, `[seq]`, `[!seq]`, an unclosed `[` is
literal), but fnmatch.translate looks for the `]` of every `[` afresh, which is quadratic in
the pattern: 100,000 unclosed `[` took minutes. Here each `[` finds its `]` through a table
built in one pass. The regex is anchored, every character in it is escaped, and each
interior `*` is an atomic lazy group, so matching never backtracks into a segment it has
passed: its cost is at most the text's length times the pattern's.
"""

from __future__ import annotations

import functools
import re

MAX_GLOB = 1024  # far longer than any cgroup path pattern; bounds the cost of one match


def _escape(c: str) -> str:
    return f"\\U{ord(c):08x}"


def _char_class(body: str) -> str:
    """The regex for fnmatch's `[body]`: after a leading `!` (negation), `a-z` is a range
    unless the `-` is first or last, or right after a range; a reversed range is empty."""
    negate = body.startswith("!")
    items = body[1:] if negate else body
    parts: list[str] = []
    i = 0
    while i < len(items):
        if i + 2 < len(items) and items[i + 1] == "-":
            low, high = items[i], items[i + 2]
            if low <= high:
                parts.append(f"{_escape(low)}-{_escape(high)}")
            i += 3
        else:
            parts.append(_escape(items[i]))
            i += 1
    if not parts:
        return "." if negate else "(?!)"
    return f"[{'^' if negate else ''}{''.join(parts)}]"


def _translate(pattern: str) -> str:
    n = len(pattern)
    next_close = [n] * (n + 1)  # the first ']' at or after each position
    for k in range(n - 1, -1, -1):
        next_close[k] = k if pattern[k] == "]" else next_close[k + 1]
    segments: list[list[str]] = [[]]  # the fixed parts between stars
    i = 0
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not (len(segments) > 1 and not segments[-1]):  # "**" is "*"
                segments.append([])
        elif c == "?":
            segments[-1].append(".")
        elif c == "[":
            start = i + 1 if i < n and pattern[i] == "!" else i
            if start < n and pattern[start] == "]":
                start += 1
            close = next_close[start]
            if close >= n:
                segments[-1].append(_escape("["))
            else:
                segments[-1].append(_char_class(pattern[i:close]))
                i = close + 1
        else:
            segments[-1].append(_escape(c))
    head, *rest = ("".join(s) for s in segments)
    if not rest:
        return rf"\A{head}\Z"
    *middle, tail = rest
    return rf"\A{head}" + "".join(f"(?>.*?{m})" for m in middle) + rf".*{tail}\Z"


@functools.lru_cache(maxsize=4096)
def compile_glob(pattern: str) -> re.Pattern[str]:
    """The compiled glob; raises ValueError for a pattern longer than MAX_GLOB characters.
    Cached, so the loader's check and every tick's classification share one compilation."""
    if len(pattern) > MAX_GLOB:
        raise ValueError(
            f"a glob is at most {MAX_GLOB} characters, got one of {len(pattern)} characters"
        )
    return re.compile(_translate(pattern), re.DOTALL)


def glob_matches(pattern: str, text: str) -> bool:
    """True when the glob `pattern` matches the whole of `text`, as fnmatch.fnmatchcase does."""
    return compile_glob(pattern).match(text) is not None
