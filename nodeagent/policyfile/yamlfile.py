"""Operator YAML files other than the policy, read with the policy loader's guards.

The same SafeLoader composition (alias bombs, duplicate keys, bad tags reported with their
position) and the same FILE:LINE:COL problems as load_policy, for files such as the
simulated GPU nodes in config/gpus/. The machinery stays in load.py; this module is its
public face for other files.
"""

from __future__ import annotations

from pydantic import ValidationError
from yaml.nodes import ScalarNode

from nodeagent.policyfile.load import (
    PolicyError,
    Problem,
    _compose_and_construct,
    _dotted,
    _Locator,
    _Report,
    read_text,
)

__all__ = ["compose", "problem_at", "read_text", "validation_problems"]

Loc = tuple[str | int, ...]


def compose(text: str, filename: str, what: str) -> tuple[_Locator, object]:
    """A locator over the YAML node tree and the plain data built from it; any problem,
    duplicate keys and keys that are not strings included, raises PolicyError."""
    report = _Report(filename)
    where, data = _compose_and_construct(text, report)
    if report.problems:
        raise PolicyError(report.sorted())
    if where is None:
        raise PolicyError([Problem(filename, 1, 1, f"the file is empty; expected {what}")])
    return where, data


def problem_at(filename: str, where: _Locator, loc: Loc, message: str) -> Problem:
    """A problem at the YAML node that `loc` names (or its closest ancestor present)."""
    mark = where.mark(loc)
    return Problem(filename, mark.line + 1, mark.column + 1, message)


def validation_problems(filename: str, where: _Locator, error: ValidationError) -> list[Problem]:
    """pydantic's errors as problems at their YAML positions, in plain words."""
    out = []
    for e in error.errors(include_url=False):
        loc = tuple(e["loc"])
        place = where.find(loc)
        node, key, found = place.node, place.key, place.found
        if e["type"] == "missing":
            message = f"missing required key {loc[-1]!r}" + (
                f" in {_dotted(loc[:-1])}" if loc[:-1] else ""
            )
        elif e["type"] == "extra_forbidden":
            node = key or node
            message = f"unknown key {loc[-1]!r}" + (f" in {_dotted(loc[:-1])}" if loc[:-1] else "")
        elif e["type"] == "string_type" and isinstance(node, ScalarNode) and node.style is None:
            # YAML 1.1 reads 00:1B:00.0 as a number in base 60, 0x10 as 16, yes as true.
            message = f"{_dotted(loc)}: must be a string; quote it: '{node.value}'"
        else:
            detail = e.get("ctx", {}).get("error") if e["type"] == "value_error" else None
            text = str(detail or e["msg"]).replace("Input should be", "must be")
            message = f"{_dotted(loc[:found])}: {text}" if found else text
        mark = node.start_mark
        problem = Problem(filename, mark.line + 1, mark.column + 1, message)
        if problem not in out:
            out.append(problem)
    return sorted(out, key=lambda p: (p.line, p.col))
