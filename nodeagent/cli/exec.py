"""`nodeagent exec`: run a command as a job the daemon manages, in a cgroup of its own."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import click

from nodeagent.cli.common import socket_option
from nodeagent.errors import NodeagentError

FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
GO = b"1"


def _value(option: str, parser: Any, text: str | None, **kwargs: Any) -> Any:
    if text is None:
        return None
    try:
        return parser(text, **kwargs)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


def _default_name(command: Sequence[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.@+-]", "-", os.path.basename(command[0]))[:40].lstrip("._-@+")
    return f"{base or 'job'}-{secrets.token_hex(3)}"


@contextlib.contextmanager
def _forwarding(pid: int) -> Iterator[None]:
    """Signals to this process go to the command's; the old handlers come back after."""

    def forward(signum: int, _: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _foreground(pgid: int) -> Iterator[int | None]:
    """On a terminal, the command's process group gets the foreground (as a shell would do),
    so Ctrl-C reaches it once, not once directly and once forwarded. Yields the terminal's
    descriptor, None when stdin is no terminal. The terminal is taken only from this
    process's own group, so a job in the background (`&`, `bg`) never steals it."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        yield None
        return
    own = os.getpgrp()
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # tcsetpgrp from the background
    try:
        _hand_over(fd, own, pgid)
        yield fd
    finally:
        _hand_over(fd, pgid, own)
        signal.signal(signal.SIGTTOU, old)


def _hand_over(fd: int, holder: int, to: int) -> None:
    """The terminal's foreground to group `to`, if group `holder` has it."""
    with contextlib.suppress(OSError):
        if os.tcgetpgrp(fd) == holder:
            os.tcsetpgrp(fd, to)


def _child(go: int, command: Sequence[str]) -> None:
    """The command's process: wait for the daemon to put it in its cgroup, then exec with
    the environment it sends (the job's GPUs)."""
    # Python's own dispositions must not reach the command: SIGINT raises KeyboardInterrupt,
    # and SIGPIPE and SIGXFSZ are ignored, which exec would keep (`cmd | head` never ends).
    for s in (*FORWARDED, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(s, signal.SIG_DFL)
    os.setpgid(0, 0)
    message = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(go, 65536):
            message += chunk
    if not message.startswith(GO):
        os._exit(125)  # the daemon refused the job: never run the command
    os.close(go)
    env = {**os.environ, **json.loads(message[len(GO) :] or b"{}")}
    try:
        os.execvpe(command[0], list(command), env)  # noqa: S606 - running it is the point
    except OSError as e:
        sys.stderr.write(f"nodeagent exec: {command[0]}: {e.strerror}\n")
        os._exit(126 if isinstance(e, PermissionError) else 127)


def _deadline_and_work(deadline: str | None, work: str | None) -> tuple[float | None, float | None]:
    """--deadline (an instant, in the future) and --work (a positive CPU duration), which go
    together; both None without them."""
    from nodeagent.policyfile.units import parse_duration
    from nodeagent.policyfile.when import parse_instant

    now = time.time()
    when = _value("--deadline", parse_instant, deadline, now=now, naive_is_local=True)
    cpu_seconds = _value("--work", parse_duration, work)
    if when is not None and when <= now:
        passed = dt.datetime.fromtimestamp(when, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        raise click.BadParameter(f"{deadline} ({passed}) has passed", param_hint="--deadline")
    if cpu_seconds is not None and cpu_seconds <= 0:
        raise click.BadParameter("the work must be positive", param_hint="--work")
    if (when is None) != (cpu_seconds is None):
        raise click.UsageError(
            "--deadline and --work go together: the rate needed is work / time left"
        )
    return when, cpu_seconds


def _wait_for_gpus(socket: str, want: dict[str, Any], timeout: float | None) -> str:
    """Ask the daemon for GPUs and wait, saying so, until they are granted; the request's id.
    Waiting requests are served by class priority, then deadline, then fair share."""
    from nodeagent.api import client
    from nodeagent.api.answers import GpuGrant

    answer = client.post_as(GpuGrant, socket, "/v1/gpus/requests", want)
    rid, said = answer.id, None
    give_up = None if timeout is None else time.monotonic() + timeout
    try:
        while answer.status != "granted":
            line = f"waiting for {want['count']} GPU(s): position {answer.position}"
            if answer.reason:
                line += f" ({answer.reason})"
            if answer.expected_start is not None:
                at = time.strftime("%H:%M:%S", time.localtime(float(answer.expected_start)))
                line += f"; expected to start at {at}"
            if line != said:
                click.echo(f"nodeagent exec: {line}", err=True)
                said = line
            if give_up is not None and time.monotonic() > give_up:
                raise NodeagentError(f"no GPUs within --gpu-timeout: {line}")
            time.sleep(1)
            answer = client.get_as(GpuGrant, socket, "/v1/gpus/requests", params={"id": rid})
    except BaseException:
        with contextlib.suppress(NodeagentError):
            client.delete(socket, "/v1/gpus/requests", {"id": rid})
        raise
    return rid


def wait(pid: int, terminal: int | None = None) -> int:
    """CMD's exit status as a shell reports it (128+N when signal N killed it).

    On a terminal (`terminal`: its descriptor, CMD's group in the foreground) this is job
    control as a shell does it: when CMD stops (Ctrl-Z, SIGSTOP, a read in the
    background), this process takes the terminal back and stops its own group with
    SIGTSTP, so the shell sees the job stopped and gets the terminal; when the shell
    continues it (fg, bg, a signal), the terminal goes back to CMD's group if this
    process is in the foreground, and CMD gets SIGCONT. Without a terminal, a stopped CMD
    is waited for as a running one."""
    flags = 0 if terminal is None else os.WUNTRACED
    while True:
        try:
            _, status = os.waitpid(pid, flags)
        except ChildProcessError:
            return 1
        if os.WIFSTOPPED(status):
            assert terminal is not None
            _suspend(pid, terminal)
            continue
        code = os.waitstatus_to_exitcode(status)
        return 128 - code if code < 0 else code


def _suspend(pgid: int, terminal: int) -> None:
    """CMD's group `pgid` stopped: stop with it, and continue it when continued."""
    own = os.getpgrp()
    _hand_over(terminal, pgid, own)
    # Stops here until SIGCONT. In an orphaned group (its shell gone) the kernel drops
    # SIGTSTP: nobody could continue it, so CMD is continued at once instead.
    os.killpg(own, signal.SIGTSTP)
    _hand_over(terminal, own, pgid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGCONT)


@click.command(
    "exec",
    context_settings={"allow_interspersed_args": False},
    epilog="""\b
Examples:
  nodeagent exec -- python train.py
  nodeagent exec --name nightly --tenant research --class training \\
      --deadline +2h --work 3h --cpus 2 --memory 8Gi --pids 512 -- ./train.sh
  nodeagent exec --deadline 2026-12-01T18:00:00Z --work 5400 -- make -j4

The job shows in `nodeagent allocations` and `nodeagent explain NAME`.""",
)
@click.option("--name", metavar="N", help="The job's name and cgroup name (default: CMD-<random>).")
@click.option(
    "--tenant", metavar="T", help="Its tenant (default: jobs.default_tenant in the policy)."
)
@click.option(
    "--class",
    "workload_class",
    metavar="C",
    help="inference, training, batch or besteffort (default: jobs.default_class, batch).",
)
@click.option(
    "--deadline",
    metavar="WHEN",
    help="When the work must be done: ISO 8601 (2026-12-01T18:00:00Z; no offset means local"
    " time) or relative (+90s, +2h). Needs --work. From a user other than root, taken"
    " only in a class whose declared_deadlines is scheduled or defended.",
)
@click.option(
    "--work",
    metavar="CPU_SECONDS",
    help="The CPU time the job needs in all: seconds or a duration (5400, 90m, 1.5h).",
)
@click.option("--cpus", metavar="X", type=float, help="At most X CPUs (cpu.max), e.g. 2 or 0.5.")
@click.option("--memory", metavar="SIZE", help="At most SIZE of memory (memory.max), e.g. 8Gi.")
@click.option(
    "--pids",
    type=click.IntRange(min=1, max=1 << 22),
    metavar="N",
    help="At most N processes and threads (pids.max), e.g. 256: a fork past it fails"
    " (EAGAIN); nothing is killed.",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    metavar="N",
    help="N GPUs, placed by topology; CMD sees only them (CUDA_VISIBLE_DEVICES). Waits"
    " while none fit.",
)
@click.option("--gpu-memory", metavar="SIZE", help="Free memory each GPU must have, e.g. 20Gi.")
@click.option(
    "--gpu-shared", is_flag=True, help="Share GPUs with other shared jobs (needs --gpu-memory)."
)
@click.option("--gpu-mig", metavar="PROFILE", help="MIG instances of PROFILE, e.g. 1g.10gb.")
@click.option(
    "--gpu-timeout", metavar="DURATION", help="Give up waiting for GPUs after this (e.g. 10m)."
)
@socket_option
@click.argument("command", nargs=-1, required=True, metavar="-- CMD [ARGS]...")
def exec_cmd(
    *,
    name: str | None,
    tenant: str | None,
    workload_class: str | None,
    deadline: str | None,
    work: str | None,
    cpus: float | None,
    memory: str | None,
    pids: int | None,
    gpus: int | None,
    gpu_memory: str | None,
    gpu_shared: bool,
    gpu_mig: str | None,
    gpu_timeout: str | None,
    socket: str,
    command: tuple[str, ...],
) -> None:
    """Run CMD as a job the daemon manages, in a cgroup of its own under the managed root.

    CMD is in that cgroup, under its limits, before its first instruction; the job is
    managed whether or not a rule matches it. A job with --deadline and --work gets the CPU
    rate it needs to finish in time (EDF), or is reported as predicted to miss; for a
    caller other than root, only in a class whose classes.<c>.declared_deadlines in the
    policy is scheduled or defended (only a defended one has lower classes throttled for
    it): refused by default. Signals
    (INT, TERM, HUP, QUIT, USR1, USR2) are passed to CMD, and this command exits with CMD's
    exit status (128+N when CMD is killed by signal N). The job and its cgroup go away when
    the cgroup empties. Nothing is started when the daemon refuses the job (unknown tenant
    or class, a name that is taken, a deadline in the past or not granted, ...).

    CMD leaves the cgroup this command runs in, but not its limits: for a caller other than
    root, each of --cpus, --memory and --pids is held to the tightest of what is asked, the
    limits of this command's own cgroup and its parents (a login's user-UID.slice: its
    cpu.max, memory.max and pids.max, systemd's CPUQuota, MemoryMax and TasksMax) and the
    policy's jobs.per_user_limits (4096 processes unless it says otherwise); left out, a
    limit is the tightest of the other two. GET /v1/jobs shows what the job got and where
    each limit came from (limits_from). Root's jobs take only what is asked.
    """
    from nodeagent.api import client
    from nodeagent.api.answers import StartedJob
    from nodeagent.policyfile.units import parse_duration, parse_size

    when, cpu_seconds = _deadline_and_work(deadline, work)
    size = _value("--memory", parse_size, memory)
    if cpus is not None and not cpus > 0:
        raise click.BadParameter("must be a positive number of CPUs", param_hint="--cpus")
    job_name = name or _default_name(command)
    grant = None
    if gpus is not None:
        want = {
            "name": job_name,
            "count": gpus,
            "memory": _value("--gpu-memory", parse_size, gpu_memory),
            "shared": gpu_shared,
            "mig": gpu_mig,
            "class": workload_class,
            "tenant": tenant,
            "deadline": when,
            "work": cpu_seconds,  # with the deadline and CPUs: how long it should hold them
            "cpus": cpus,
        }
        timeout = _value("--gpu-timeout", parse_duration, gpu_timeout)
        grant = _wait_for_gpus(socket, {k: v for k, v in want.items() if v is not None}, timeout)

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(write_end)
        _child(read_end, command)
    os.close(read_end)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also here: whichever of the two runs first
    request = {
        "name": job_name,
        "tenant": tenant,
        "class": workload_class,
        "deadline": when,
        "work": cpu_seconds,
        "cpus": cpus,
        "memory": size,
        "pids": pids,
        "pid": pid,
        "gpu_request": grant,
    }
    # Signals are passed on from here: one that comes before the command runs ends the
    # waiting process, and with it the job, as it would end the command.
    with _forwarding(pid):
        try:
            started = client.post_as(
                StartedJob, socket, "/v1/jobs", {k: v for k, v in request.items() if v is not None}
            )
        except NodeagentError:
            os.close(write_end)  # the child reads no go and exits without running anything
            wait(pid)
            if grant is not None:
                with contextlib.suppress(NodeagentError):
                    client.delete(socket, "/v1/gpus/requests", {"id": grant})
            raise
        env = started.env
        with _foreground(pid) as terminal:
            with contextlib.suppress(OSError):  # the child died of a signal meanwhile
                os.write(write_end, GO + json.dumps(env).encode())
            os.close(write_end)
            code = wait(pid, terminal)
    with contextlib.suppress(NodeagentError):
        client.delete(socket, "/v1/jobs", {"name": job_name, "exit_status": code})
    sys.exit(code)
