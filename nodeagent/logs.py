"""structlog setup: JSON lines for journald and benchmarks, a readable console on a terminal.

Every JSON record carries "ts" as unix seconds (a float) so that benchmarks can line log
events up with their own clocks without parsing dates; the console shows local time.
"""

from __future__ import annotations

import logging
import sys

import structlog

from nodeagent.errors import NodeagentError

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
        processors += [
            structlog.processors.TimeStamper(fmt=None, key="ts"),  # unix float seconds
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    else:  # a person is reading: local wall-clock time, colours only on a real terminal
        processors += [
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False, key="ts"),
            structlog.dev.ConsoleRenderer(timestamp_key="ts", colors=sys.stderr.isatty()),
        ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # Not cached: module-level loggers must follow a later configure() (tests, reload).
        cache_logger_on_first_use=False,
    )


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
