"""`nodeagent exec` on a terminal: job control as a shell does it (issue 12, item 21).

Ctrl-Z hung the session: exec waited for its command without WUNTRACED, so it never
stopped when the command did, the shell never saw the job stop, and the terminal stayed
with the stopped command's group. Here the real console script runs on a pseudo-terminal
under a minimal job-control shell (JOB_SHELL, as bash does it: own group per job,
tcsetpgrp, waitpid with WUNTRACED, `fg` = tcsetpgrp + SIGCONT), against a stand-in for
the daemon's API (POST and DELETE /v1/jobs); it does not put CMD in a cgroup. Also: the
options exec refuses itself, before it asks a daemon.
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.api.answers import StartedJob
from nodeagent.api.server import ApiServer, Request
from nodeagent.cli.exec import wait

JOB_SHELL = r"""
# a job-control shell of one job: `fg` gives it the terminal and continues it, `bg` only
# continues it; it says what it sees on the terminal as SHELL: lines
import os, signal, sys
for s in (signal.SIGTTOU, signal.SIGTTIN, signal.SIGTSTP):
    signal.signal(s, signal.SIG_IGN)  # an interactive shell's own dispositions
tty, shell = 0, os.getpgrp()

def say(text):
    os.write(1, f"SHELL: {text}\r\n".encode())

job = os.fork()
if job == 0:
    os.setpgid(0, 0)
    for s in (signal.SIGTTOU, signal.SIGTTIN, signal.SIGTSTP):
        signal.signal(s, signal.SIG_DFL)
    os.execv(sys.argv[1], sys.argv[1:])
try:
    os.setpgid(job, job)
except OSError:
    pass
os.tcsetpgrp(tty, job)
say(f"job {job}")
for round in range(3):
    _, status = os.waitpid(job, os.WUNTRACED)
    os.tcsetpgrp(tty, shell)  # the shell takes its terminal back
    if not os.WIFSTOPPED(status):
        say(f"exit {os.waitstatus_to_exitcode(status)}")
        break
    say(f"stopped by {signal.Signals(os.WSTOPSIG(status)).name}")
    line = sys.stdin.readline().strip()  # reads only while the terminal is the shell's
    say(f"read {line}")
    if line == "fg":
        os.tcsetpgrp(tty, job)
    os.killpg(job, signal.SIGCONT)
"""

CMD = (
    "import sys; print('ready', flush=True); line = sys.stdin.readline();"
    " print('cmd got', line.strip(), flush=True); sys.exit(3)"
)


@pytest.fixture
def daemon() -> Iterator[str]:
    """The daemon's API, as far as exec needs it: a job is accepted, and finished."""
    sockdir = Path(tempfile.mkdtemp(prefix="nodeagent-exec-"))

    def start(request: Request) -> StartedJob:
        name = str(request.body.get("name"))
        return StartedJob(
            name=name, cgroup=f"nodeagent.slice/{name}", tenant="t", workload_class="batch",
            uid=os.getuid(), pid=int(request.body["pid"]), submitted_at=1.0, deadline=None,
            work=None, cpus=None, memory=None, gpus=[], gpu_hold=None, pinned_cpus=[],
            pids=None, limits_from={}, env={"NODEAGENT_TEST": "1"},
        )  # fmt: skip

    server = ApiServer(
        str(sockdir / "api.sock"),
        {"/v1/jobs": {"POST": start, "DELETE": lambda _: {"ok": True}}},
    )
    server.start()
    yield server.socket_path
    server.close()
    shutil.rmtree(sockdir, ignore_errors=True)


class Terminal:
    """The test's end of the pseudo-terminal: what was shown, and waiting for more."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.shown = ""
        self.read_to = 0  # what `expect` has matched so far

    def expect(self, text: str, timeout: float) -> None:
        """Wait for `text` to show after what the last expect matched."""
        deadline = time.monotonic() + timeout
        while (at := self.shown.find(text, self.read_to)) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"no {text!r} within {timeout:.0f} s; shown:\n{self.shown}")
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: every process on the terminal is gone
                chunk = b""
            if not chunk:
                raise AssertionError(f"the terminal closed before {text!r}; shown:\n{self.shown}")
            self.shown += chunk.decode(errors="replace")
        self.read_to = at + len(text)

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())


def nodeagent_script() -> list[str]:
    script = Path(sys.executable).parent / "nodeagent"
    assert script.exists(), f"the console script is not installed at {script}"
    return [str(script)]


def test_ctrl_z_stops_the_job_and_fg_resumes_it_to_completion(daemon: str) -> None:
    """^Z, then fg: the shell gets the job stopped and its terminal back; fg gives the
    terminal to exec, which hands it to CMD and continues it."""
    with job_on_a_terminal(daemon) as term:
        term.type("\x1a")  # Ctrl-Z: SIGTSTP to the terminal's foreground group, CMD's
        term.expect("SHELL: stopped by SIGTSTP", timeout=60)  # it hung here
        term.type("fg\n")  # read by the shell: the terminal is its own again
        term.expect("SHELL: read fg", timeout=60)
        term.type("hello\n")  # read by CMD: exec gave it the terminal back, and SIGCONT
        term.expect("cmd got hello", timeout=60)
        term.expect("SHELL: exit 3", timeout=60)
        assert "stopped by" not in term.shown.split("SHELL: read fg")[1]  # no SIGTTIN


def test_after_ctrl_z_bg_leaves_the_terminal_to_the_shell(daemon: str) -> None:
    """^Z, then bg (SIGCONT alone): exec, continued in the background, must not take the
    terminal for CMD; CMD's read from it stops the job again (SIGTTIN), and fg ends it."""
    with job_on_a_terminal(daemon) as term:
        term.type("\x1a")
        term.expect("SHELL: stopped by SIGTSTP", timeout=60)
        term.type("bg\n")
        term.expect("SHELL: read bg", timeout=60)
        # CMD reads in the background: SIGTTIN stops it, and exec with it
        term.expect("SHELL: stopped by", timeout=60)
        assert term.shown.count("SHELL: stopped by") == 2
        term.type("fg\n")
        term.expect("SHELL: read fg", timeout=60)
        term.type("hello\n")
        term.expect("cmd got hello", timeout=60)
        term.expect("SHELL: exit 3", timeout=60)


@contextlib.contextmanager
def job_on_a_terminal(daemon: str) -> Iterator[Terminal]:
    """`nodeagent exec -- CMD` as the one job of JOB_SHELL on a new pseudo-terminal, once
    CMD is running (it said ready); afterwards the shell has exited 0 or is killed."""
    command = [*nodeagent_script(), "exec", "--socket", daemon, "--", sys.executable, "-c", CMD]
    pid, fd = pty.fork()
    if pid == 0:  # the session leader on the terminal: the job-control shell
        try:
            os.execv(sys.executable, [sys.executable, "-c", JOB_SHELL, *command])
        finally:
            os._exit(127)
    term = Terminal(fd)
    try:
        # generous: Python starts slowly on a busy machine; nothing after it is timed
        term.expect("ready", timeout=120)
        yield term
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        with contextlib.suppress(ProcessLookupError, IndexError, ValueError):
            job = int(term.shown.split("SHELL: job ")[1].split()[0])
            os.killpg(job, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def test_without_a_terminal_a_stopped_command_is_waited_for_as_a_running_one() -> None:
    """No job control without a terminal: stopping and continuing the command changes
    nothing for exec, which returns its exit status."""
    child = os.fork()
    if child == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(7)
    seen = os.waitid(os.P_PID, child, os.WSTOPPED | os.WNOWAIT)
    assert seen is not None and seen.si_code == os.CLD_STOPPED
    os.kill(child, signal.SIGCONT)
    assert wait(child) == 7


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--deadline", "2001-01-01T00:00:00Z", "--work", "10"], "has passed"),
        (["--deadline", "+60s", "--work", "0"], "the work must be positive"),
        (["--deadline", "+60s"], "--deadline and --work go together"),
    ],
)
def test_options_the_cli_refuses_run_nothing_and_ask_no_daemon(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """Refused before any daemon is asked (the socket named does not exist: a request would
    say so instead), in one line, and the command never runs. The refusals the daemon
    makes are tests/kernel/test_exec.py's."""
    marker = tmp_path / "ran"
    cli = subprocess.run(
        [sys.executable, "-m", "nodeagent", "exec", "--socket", str(tmp_path / "none.sock"),
         *args, "--", "touch", str(marker)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert cli.returncode == 2, cli.stderr
    assert message in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert "no nodeagent daemon" not in cli.stderr
    assert "Traceback" not in cli.stderr
    assert not marker.exists()
