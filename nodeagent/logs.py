"""structlog setup: JSON lines for journald and benchmarks, a readable console on a terminal.

Every JSON record carries "ts" as unix seconds (a float) so that benchmarks can line log
events up with their own clocks without parsing dates; the console shows local time.

When stderr is the journal (systemd says so in $JOURNAL_STREAM), each line starts with its
syslog priority, `<3>` for an error (sd-daemon(3)): journald strips it and files the line at
that priority, so `journalctl -p err -u nodeagent` shows `policy.invalid`. On the console,
control characters in strings (a cgroup path can hold any byte but "/") are shown as their
Unicode pictures, never sent to the terminal: JSON escapes them already.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from nodeagent.errors import NodeagentError
from nodeagent.journal import stderr_is_the_journal

# Audit events bypass the level filter: an operator who turns logging down to "error" still
# needs the record of every cgroup write.
_audit = structlog.wrap_logger(
    None,
    wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
    logger_factory_args=("nodeagent.audit",),
)


def configure(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog globally, writing to stderr; `json=None` means JSON unless a TTY."""
    levels = logging.getLevelNamesMapping()
    number = levels.get(level.upper())
    if number is None or level.upper() in ("NOTSET", "WARN", "FATAL"):
        raise NodeagentError(
            f"unknown log level {level!r}; use debug, info, warning, error or critical"
        )
    use_json = not sys.stderr.isatty() if json is None else json
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
    ]
    if use_json:
        render = structlog.processors.JSONRenderer()
        processors += [
            structlog.processors.TimeStamper(fmt=None, key="ts"),  # unix float seconds
            structlog.processors.format_exc_info,
            _with_priority(render) if stderr_is_the_journal() else render,
        ]
    else:  # a person is reading: local wall-clock time, colours only on a real terminal
        processors += [
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False, key="ts"),
            structlog.processors.format_exc_info,  # as text, so that it is escaped too
            escape_controls,
            structlog.dev.ConsoleRenderer(timestamp_key="ts", colors=console_colours()),
        ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # Not cached: module-level loggers must follow a later configure() (tests, reload).
        cache_logger_on_first_use=False,
    )


def console_colours() -> bool:
    """Colours only on a real terminal, and never when NO_COLOR is set to anything but
    the empty string (no-color.org)."""
    return sys.stderr.isatty() and not os.environ.get("NO_COLOR")


# syslog(3) priorities by structlog level name; an unknown name is logged as info
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "critical": 2}


def _with_priority(render: Any) -> Any:
    """The JSON line behind its `<N>` priority prefix, for journald."""

    def render_for_journal(logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
        priority = PRIORITY.get(str(event.get("level", method)), 6)
        return f"<{priority}>{render(logger, method, event)}"

    return render_for_journal


# C0 controls and DEL as their Unicode pictures (U+2400..U+2421: ␛ for ESC, ␊ for a newline),
# which no terminal acts on and repr() leaves alone; C1 controls (no pictures) as \\x9b text
_CONTROLS = {
    **{c: chr(0x2400 + c) for c in range(0x20)},
    0x7F: "\u2421",
    **{c: f"\\x{c:02x}" for c in range(0x80, 0xA0)},
}
_CONTROLS_BUT_LINES = {c: v for c, v in _CONTROLS.items() if c != 0x0A}


def escape_controls(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Control characters in the console's strings shown as pictures (`␛]0;x␇`), so that a
    path holding an escape sequence prints as text instead of driving the terminal, and a
    newline in a value cannot forge a second record. A traceback keeps its newlines. Other
    values are printed by repr(), which escapes them already."""
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = value.translate(_CONTROLS_BUT_LINES if key == "exception" else _CONTROLS)
    return event


def audit_write(path: str, attribute: str, old: str | None, new: str, reason: str) -> None:
    """Record one cgroup attribute write: where, what, the value before and after, and why."""
    _audit.info("cgroup.write", path=path, attribute=attribute, old=old, new=new, reason=reason)


def audit_event(event: str, **fields: object) -> None:
    """Record an action on something other than a cgroup file (a GPU granted, released or
    power-capped, a GPU violation), in the same audit stream as the cgroup writes."""
    _audit.info(event, **fields)


def audit_warning(event: str, **fields: object) -> None:
    """An audit event that is also something to act on (a GPU violation): level warning."""
    _audit.warning(event, **fields)
