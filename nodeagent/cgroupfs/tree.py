"""Safe access to a cgroup tree under an injectable root.

Every path is relative to the root and walked one component at a time with
O_NOFOLLOW, so no path can leave the root through '..' or a symlink, even one
planted after validation. A cgroup that disappears under us raises
`CgroupVanished`, which callers treat as normal: workloads come and go.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from nodeagent.cgroupfs.paths import split_path
from nodeagent.errors import NodeagentError, UnsafePath

AuditFn = Callable[[str, str, str | None, str, str], None]
"""Called for every write: (path, attribute, old value, new value, reason)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_VANISHED = {errno.ENOENT, errno.ENODEV, errno.ESTALE}


class CgroupVanished(Exception):
    """The cgroup was removed while we were using it. Not an error: skip it."""

    def __init__(self, path: str) -> None:
        super().__init__(f"cgroup {path or '/'} vanished")
        self.path = path


class CgroupWriteError(NodeagentError):
    """The kernel refused a write; the message names the cgroup, file and value."""


class CgroupReadError(NodeagentError):
    """An interface file could not be opened or read; `errno` says why (EOPNOTSUPP for
    pressure files on a kernel booted without PSI)."""

    def __init__(self, message: str, errno_: int | None) -> None:
        super().__init__(message)
        self.errno = errno_


def _file_name(name: str) -> str:
    """Interface files are single names: a '/', '..' or NUL here could leave the cgroup."""
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise UnsafePath(f"{name!r} is not a cgroup interface file name")
    return name


class CgroupDir:
    """An open cgroup directory; files are opened relative to it, never following symlinks."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    def _open_file(self, name: str, mode: int) -> int:
        _file_name(name)
        try:
            return os.open(name, mode | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as e:
            raise self._translate(e, name) from e

    def read(self, name: str) -> str:
        fd = self._open_file(name, os.O_RDONLY)
        try:
            raw = os.read(fd, 1 << 16)
        except OSError as e:
            raise self._translate(e, name) from e
        finally:
            os.close(fd)
        return self._text(raw, name)

    def _text(self, raw: bytes, name: str) -> str:
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise CgroupReadError(
                f"cgroup {self.path or '/'}: {name} is not ASCII text: {raw[:40]!r}", None
            ) from None

    def read_optional(self, name: str) -> str | None:
        """Like read, but None when the file is absent because its controller is not enabled."""
        try:
            return self.read(name)
        except CgroupVanished:
            if self.has("cgroup.procs"):
                return None
            raise

    def write(self, name: str, value: str) -> None:
        fd = self._open_file(name, os.O_WRONLY)
        try:
            os.write(fd, value.encode())
        except OSError as e:
            if e.errno in _VANISHED:
                raise CgroupVanished(self.path) from e
            raise CgroupWriteError(
                f"cgroup {self.path or '/'}: writing {value!r} to {name} failed: {e.strerror}"
            ) from e
        finally:
            os.close(fd)

    def has(self, name: str) -> bool:
        _file_name(name)
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError as e:
            if e.errno in _VANISHED:
                return False
            raise
        return True

    def subdirs(self) -> list[str]:
        """Child cgroups, skipping anything that is not a real directory (symlinks included)."""
        return self.listing()[0]

    def listing(self) -> tuple[list[str], list[str]]:
        """(child cgroups, symlinks): the real directories, and the names of the symlinks,
        which cgroupfs never holds (one was planted, through a mount) and nothing follows."""
        dirs, links = [], []
        try:
            with os.scandir(self.fd) as it:
                for e in it:
                    if e.is_symlink():
                        links.append(e.name)
                    elif e.is_dir(follow_symlinks=False):
                        dirs.append(e.name)
        except OSError as e:
            raise self._translate(e, ".") from e
        return dirs, links

    def _translate(self, e: OSError, name: str) -> Exception:
        if e.errno in _VANISHED:
            return CgroupVanished(self.path)
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return UnsafePath(f"cgroup {self.path or '/'}: {name} is a symlink or not a file")
        return CgroupReadError(
            f"cgroup {self.path or '/'}: cannot read {name}: {e.strerror}", e.errno
        )


class KeptDir(CgroupDir):
    """A cgroup directory kept open from tick to tick, the files read every tick kept open
    in it: kernfs makes a file's content anew at each read from offset 0, so reading one
    again is one pread, not an openat, a read and a close (cpu.stat in the VM: 13 against
    70 us). A kept file of a removed cgroup reads ENODEV: CgroupVanished."""

    def __init__(self, path: str, fd: int) -> None:
        super().__init__(path, fd)
        self._files: dict[str, int] = {}

    def reread(self, name: str) -> str:
        """`name`, opened on the first call and kept open for the next ones."""
        fd = self._files.get(name)
        if fd is None:
            fd = self._files[name] = self._open_file(name, os.O_RDONLY)
        try:
            raw = os.pread(fd, 1 << 16, 0)
        except OSError as e:
            raise self._translate(e, name) from e
        return self._text(raw, name)

    def close(self) -> None:
        """The directory and every file kept in it."""
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        os.close(self.fd)


class CgroupTree:
    """A cgroup hierarchy rooted at `root` (normally /sys/fs/cgroup; a fixture tree in tests)."""

    def __init__(self, root: str = "/sys/fs/cgroup") -> None:
        self.root = os.path.realpath(root)

    def path_of(self, path: str) -> str:
        """The absolute path, for messages and audit logs only: never opened by name."""
        return os.path.join(self.root, *split_path(path))

    @contextmanager
    def open(self, path: str) -> Iterator[CgroupDir]:
        fd = self.open_fd(path)
        try:
            yield CgroupDir(path, fd)
        finally:
            os.close(fd)

    def open_fd(self, path: str) -> int:
        """A directory fd for the cgroup at `path`, walked as `open` walks it; the caller
        closes it. Kept open, it still names the same cgroup when another takes its path:
        files opened through it then fail with ENOENT (CgroupVanished)."""
        parts = split_path(path)
        try:
            fd = os.open(self.root, _DIR_FLAGS)
        except OSError as e:
            raise NodeagentError(f"cannot open cgroup root {self.root}: {e.strerror}") from e
        try:
            for part in parts:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        except OSError as e:
            os.close(fd)
            if e.errno in _VANISHED:
                raise CgroupVanished(path) from e
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafePath(f"cgroup path {path!r} passes through a symlink") from e
            raise NodeagentError(f"cannot open cgroup {path}: {e.strerror}") from e
        return fd

    def exists(self, path: str) -> bool:
        """Whether the cgroup at `path` is there now (one that cannot be opened is not)."""
        try:
            os.close(self.open_fd(path))
        except (CgroupVanished, NodeagentError):
            return False
        return True

    def mkdir(self, path: str) -> bool:
        """Create one cgroup whose parent exists; False when it already existed."""
        parts = split_path(path)
        if not parts:
            return False
        with self.open("/".join(parts[:-1])) as parent:
            try:
                os.mkdir(parts[-1], 0o755, dir_fd=parent.fd)
            except FileExistsError:
                st = os.stat(parts[-1], dir_fd=parent.fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    raise UnsafePath(
                        f"cgroup path {path!r} exists and is not a directory"
                    ) from None
                return False
            except OSError as e:  # EROFS, EAGAIN (cgroup.max.descendants), EACCES, ...
                raise NodeagentError(f"cannot create cgroup {path}: {e.strerror}") from e
        return True
