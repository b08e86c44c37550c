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


def one_line(e: BaseException) -> str:
    """An error as one log-safe line; nodeagent's own errors already name the file or cgroup,
    anything else (a parser's ValueError, say) is prefixed with its type."""
    text = " ".join(str(e).split())
    if isinstance(e, NodeagentError):
        return text or type(e).__name__
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
