"""Errors an operator sees as one line: what went wrong and which file, line or cgroup."""


class NodeagentError(Exception):
    """Base of every error that the CLI prints as a single line, without a traceback."""


class CgroupUnavailable(NodeagentError):
    """The host cannot give nodeagent a usable cgroup v2 hierarchy."""


class UnsafePath(NodeagentError, ValueError):
    """A cgroup path that would leave the cgroup root or pass through a symlink."""


class InvalidValue(NodeagentError):
    """A value that the kernel interface would reject or silently round."""


class DaemonUnreachable(NodeagentError):
    """The CLI found no daemon on the local API socket."""


class Refused(NodeagentError):
    """A request the daemon will not carry out, said in one line. Domain code raises one of
    its kinds; the API answers each with its HTTP status (nodeagent.api.server.STATUS)."""


class BadRequest(Refused):
    """The request is well-formed but makes no sense (a bad value, a missing half of a pair)."""


class Forbidden(Refused):
    """The caller may ask, but not for this: another user's job, GPU, hold or pid."""


class NotFound(Refused):
    """The thing asked for does not exist."""


class Conflict(Refused):
    """The request clashes with the current state, e.g. a name already taken."""


class TryLater(Refused):
    """The daemon cannot answer now, e.g. its loop did not take the request in time."""


def one_line(e: BaseException) -> str:
    """An error as one log-safe line; nodeagent's own errors already name the file or cgroup,
    anything else (a parser's ValueError, say) is prefixed with its type."""
    text = " ".join(str(e).split())
    if isinstance(e, NodeagentError):
        return text or type(e).__name__
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
