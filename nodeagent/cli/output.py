"""What every command's output shares: the --json document, counted nouns, the width
tables fit.

--json is the stable interface for scripts (documented in docs/commands.md): one JSON object,
`{"apiVersion": "nodeagent/v1", "kind": KIND, ...}`, lists under `items` (kind ...List),
and every figure with its unit in its key (`_bytes`, `_cores`, `_seconds`,
`_timestamp_seconds` for unix times, `_fraction` for 0..1, `_percent`, `_per_second`,
`_watts`, `_celsius`). Keys may be added within a version; none is renamed or removed
without a new apiVersion.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

import click

API_VERSION = "nodeagent/v1"


def document(kind: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The --json object of one read command: apiVersion and kind first, then `body`, which
    must not have either key (a workload's own `kind` goes in an item or under a key)."""
    if "apiVersion" in body or "kind" in body:
        raise ValueError(f"a {kind} document's body has its own apiVersion or kind")
    return {"apiVersion": API_VERSION, "kind": kind, **body}


def item_list(kind: str, items: Iterable[Any], **extra: Any) -> dict[str, Any]:
    """The --json object of a listing: kind KIND (such as WorkloadList), `items`."""
    return document(kind, {**extra, "items": list(items)})


def echo_json(doc: Mapping[str, Any]) -> None:
    """Print a --json document: indented, ASCII only (names that are not UTF-8 stay exact as
    escapes), keys in the order the document gives them."""
    click.echo(json.dumps(doc, indent=2, ensure_ascii=True))


def renamed(obj: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """`obj` with the keys in `names` renamed (to say their units), the others as they are,
    in their order."""
    return {names.get(k, k): v for k, v in obj.items()}


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 tenant', '2 tenants', '0 rules'."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


DEFAULT_WIDTH = 80
"""A terminal's width where it does not say one (a serial console, some CI terminals)."""


def terminal_width() -> int | None:
    """The width tables are fitted to: COLUMNS, else the terminal's on stdout, else 80 on a
    terminal that does not say; None when stdout is a pipe or a file without COLUMNS (it
    gets whole lines, for grep and for scripts that read the table)."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    stdout = sys.stdout  # what click.echo writes to
    try:
        if not stdout.isatty():
            return None
        columns = os.get_terminal_size(stdout.fileno()).columns
    except (OSError, ValueError):  # no file descriptor (a test's stream), or a closed one
        return None
    return columns if columns > 0 else DEFAULT_WIDTH


def report(log_format: str, event: str, text: str, *, level: str = "info", **fields: Any) -> None:
    """One line of what a command a unit runs has to say (validate's problems, reload's
    answer, release's results), alike with the daemon's log: `text` as it is, or with
    --log-format json the record {"event", "level", "message", **fields}. Warnings and
    errors go to stderr, filed at their priority when stderr is the journal (`<3>`, as
    sd-daemon(3) says), so `journalctl -p err -u nodeagent` shows them."""
    from nodeagent.journal import prefixed, stderr_is_the_journal

    if log_format == "json":
        record = {"event": event, "level": level, "ts": time.time(), "message": text, **fields}
        line = json.dumps(record)
    else:
        line = text
    err = level not in ("debug", "info")
    if err and stderr_is_the_journal():
        line = prefixed(level, line)
    click.echo(line, err=err)
