"""structlog setup: entries for journald, JSON lines for shippers and benchmarks, a readable
console on a terminal.

Where the records go (`--log-format`, or $NODEAGENT_LOG_FORMAT):
- **journal** (what `auto` picks when stderr is the journal: systemd says so in
  $JOURNAL_STREAM): one native journal entry per record. MESSAGE is a line a person reads,
  `cgroup.write path=/system.slice/docker-3f.scope attribute=cpu.max old=max new="25000
  100000" reason=...`, so that `journalctl -u nodeagent` and `systemctl status nodeagent` read
  like other services; every field is its own journal field as well (NODEAGENT_EVENT,
  NODEAGENT_PATH, ...), so `journalctl -o json` keeps them and `journalctl
  NODEAGENT_EVENT=gpu.violation` finds them; PRIORITY is the level's syslog priority, so
  `journalctl -p err -u nodeagent` shows policy.invalid. An entry journald does not take
  (restarting, its queue full for a second) is written to stderr as its line instead.
- **json** (`auto` when stderr is neither the journal nor a terminal: a pipe, a container's
  log): one JSON object per line, "ts" as unix seconds (a float) so that benchmarks line
  events up with their own clocks without parsing dates. On the journal's stream each line
  starts with its syslog priority, `<3>` for an error (sd-daemon(3)), which journald strips.
- **console** (`auto` on a terminal): local time, the event and its fields, colours unless
  NO_COLOR. Control characters in strings (a cgroup path can hold any byte but "/") are shown
  as pictures or escapes, never sent to the terminal or the journal's MESSAGE.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

from nodeagent import journal
from nodeagent.errors import NodeagentError
from nodeagent.journal import stderr_is_the_journal
from nodeagent.tables import printable

# Audit events bypass the level filter: an operator who turns logging down to "error" still
# needs the record of every cgroup write.
_audit = structlog.wrap_logger(
    None,
    wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
    logger_factory_args=("nodeagent.audit",),
)


def configure(level: str = "info", fmt: str = "auto") -> str:
    """Configure structlog globally for `fmt` (journal.FORMATS; the module's docstring) and
    `level`; returns the format chosen."""
    levels = logging.getLevelNamesMapping()
    number = levels.get(level.upper())
    if number is None or level.upper() in ("NOTSET", "WARN", "FATAL"):
        raise NodeagentError(
            f"unknown log level {level!r}; use debug, info, warning, error or critical"
        )
    chosen = journal.choose_format(fmt)
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
    ]
    factory: Any = structlog.PrintLoggerFactory(file=sys.stderr)
    if chosen == "journal":
        processors += [structlog.processors.format_exc_info, journal_entry]
        factory = JournalLoggerFactory(journal.Journal(journal.SOCKET))
    elif chosen == "json":
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
        logger_factory=factory,
        # Not cached: module-level loggers must follow a later configure() (tests, reload).
        cache_logger_on_first_use=False,
    )
    return chosen


def message(event: str, fields: Mapping[str, Any]) -> str:
    """A record as one line a person reads, the way structured logs of other daemons read
    (klog, logfmt): the event, then `key=value` for each field in order. A value with a
    space, a quote (escaped), an equals sign or nothing in it is quoted; one that is not a
    string is written as compact JSON (null, true, ["GPU-a","GPU-b"]). Whatever a terminal
    or journalctl would not show as text is escaped (`printable`), so a cgroup name cannot
    forge a second line."""
    parts = [printable(event)]
    for key, value in fields.items():
        if isinstance(value, str):
            text = printable(value)
            if not text or any(c in text for c in ' "='):
                text = '"' + text.replace('"', '\\"') + '"'
        else:
            text = printable(_compact_json(value))
        parts.append(f"{printable(key)}={text}")
    return " ".join(parts)


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def journal_entry(
    _logger: Any, method: str, event: MutableMapping[str, Any]
) -> tuple[tuple[bytes, str], dict[str, Any]]:
    """The record as one native journal entry: MESSAGE (`message`, then the traceback if
    any), PRIORITY, SYSLOG_IDENTIFIER, and each field as NODEAGENT_<KEY> with its value as
    it is (a string) or as JSON. Handed to JournalLogger with the line to write to stderr
    instead, should journald not take it."""
    level = str(event.pop("level", method))
    name = str(event.pop("event", ""))
    exception = event.pop("exception", None)
    text = message(name, event)
    if exception is not None:
        # escaped as the line above is, line by line: a traceback keeps its newlines
        text += "\n" + "\n".join(printable(line) for line in str(exception).split("\n"))
    fields = [
        ("MESSAGE", text),
        ("PRIORITY", str(journal.PRIORITY.get(level, 6))),
        ("SYSLOG_IDENTIFIER", "nodeagent"),
        (journal.field_name("event"), name),
    ]
    for key, value in event.items():
        as_text = value if isinstance(value, str) else _compact_json(value)
        fields.append((journal.field_name(key), as_text))
    if exception is not None:
        fields.append((journal.field_name("exception"), str(exception)))
    return (journal.encode(fields), journal.prefixed(level, text)), {}


class JournalLogger:
    """structlog's logger for `journal_entry`'s output: sends the entry, and when journald
    does not take it, writes its line to stderr (behind its priority) so nothing is lost."""

    def __init__(self, sink: journal.Journal) -> None:
        self._sink = sink

    def msg(self, entry: bytes, line: str) -> None:
        try:
            self._sink.send(entry)
        except OSError:
            print(line, file=sys.stderr, flush=True)

    debug = info = warning = error = critical = exception = log = msg


class JournalLoggerFactory:
    """One JournalLogger over one socket for every logger structlog asks for."""

    def __init__(self, sink: journal.Journal) -> None:
        self._logger = JournalLogger(sink)

    def __call__(self, *_args: Any) -> JournalLogger:
        return self._logger


def console_colours() -> bool:
    """Colours only on a real terminal, and never when NO_COLOR is set to anything but
    the empty string (no-color.org)."""
    return sys.stderr.isatty() and not os.environ.get("NO_COLOR")


def _with_priority(render: Any) -> Any:
    """The JSON line behind its `<N>` priority prefix, for journald."""

    def render_for_journal(logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
        return journal.prefixed(str(event.get("level", method)), render(logger, method, event))

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
