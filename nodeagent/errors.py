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
