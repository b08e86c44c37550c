"""Harness for the real-kernel tests.

These tests run as root on a real cgroup v2 kernel (``./scripts/test kernel`` boots one in a VM when
this host is not one). Anywhere else every test FAILS with a one-line reason: a kernel test that
silently skips proves nothing, so skips are turned into failures too.

``cgroup_sandbox`` gives a test a fresh, uniquely named cgroup directly under the cgroup2 root,
with ``cpu`` and ``memory`` enabled for its children. Create child cgroups in it and put processes
there (the sandbox itself has controllers enabled in its subtree_control, so by the kernel's
no-internal-processes rule it cannot hold processes). On teardown everything left in it is killed
and the whole tree is removed.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from nodeagent.gpu.model import parse_cpulist

CGROUP_ROOT = Path("/sys/fs/cgroup")
REQUIRED_CONTROLLERS = ("cpu", "memory")
SANDBOX_PREFIX = "nodeagent-test"
TEARDOWN_TIMEOUT_S = 10.0

_sandbox_numbers = itertools.count()


def _mount_fstype(mount_point: Path) -> str | None:
    """Filesystem type mounted at ``mount_point`` (the last, visible, mount), from mountinfo."""
    fstype = None
    with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            if len(fields) > 4 and fields[4] == str(mount_point) and "-" in fields:
                fstype = fields[fields.index("-", 6) + 1]
    return fstype


def environment_problem() -> str | None:
    """Why this is not a place to run the kernel tests, or None when it is."""
    hint = "run them with ./scripts/test kernel"
    if os.geteuid() != 0:
        return f"kernel tests must run as root ({hint})"
    fstype = _mount_fstype(CGROUP_ROOT)
    if fstype != "cgroup2":
        return f"{CGROUP_ROOT} is not a cgroup2 mount (it is {fstype or 'not mounted'}; {hint})"
    try:
        controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return f"cannot read {CGROUP_ROOT}/cgroup.controllers: {exc}"
    missing = [c for c in REQUIRED_CONTROLLERS if c not in controllers]
    if missing:
        return f"cgroup2 root lacks the {' and '.join(missing)} controller(s) ({hint})"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable ({hint})"
    return None


@pytest.fixture(scope="session", autouse=True)
def _require_real_cgroup2() -> None:
    problem = environment_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A kernel test must never skip: report a skip as a failure. The test's ceiling is paused
    while the report is made (see _pause_ceiling)."""
    left = _pause_ceiling()
    try:
        outcome = yield
    finally:
        _resume_ceiling(left)
    report: pytest.TestReport = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"kernel tests must never skip, but this one did: {reason}"


# -- ceilings: no test can hang the suite ---------------------------------------------------------
# pytest-timeout (the signal method, pyproject.toml) fails a test that runs past its ceiling and
# goes on with the next one; the ceiling covers its setup (a session fixture's start counts
# against the first test that uses it) and its teardown.
TEST_TIMEOUT_S = 300
"""The ceiling of a kernel test without a ``@pytest.mark.timeout(N)`` of its own."""
LONGEST_TEST_S = 900
"""No test may cost the suite more: a marker above it is refused at collection."""


def _ceil_every_test(items: list[pytest.Item]) -> None:
    starts: set[str] = set()
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = TEST_TIMEOUT_S if marker is None else marker.kwargs.get("timeout")
        if marker is not None and marker.args:
            seconds = marker.args[0]
        if not isinstance(seconds, int | float) or not 0 < seconds <= LONGEST_TEST_S:
            raise pytest.UsageError(
                f"{item.nodeid}: timeout {seconds!r}: a kernel test's ceiling must be"
                f" 1..{LONGEST_TEST_S} s"
            )
        # the first user of a shared daemon set starts it within its own ceiling, and each
        # worker's first test after the ALONE ones may wait for them (see ALONE)
        for name in SHARED_START_S.keys() & set(getattr(item, "fixturenames", ())) - starts:
            starts.add(name)
            seconds += SHARED_START_S[name]
        waits = f"after the ALONE tests: {_worker_group(item.nodeid)}"
        if _alone_last and _module(item.nodeid) not in ALONE and waits not in starts:
            starts.add(waits)
            seconds += ALONE_WAIT_S
        item.add_marker(pytest.mark.timeout(min(seconds, LONGEST_TEST_S)), append=False)


# pytest-timeout's alarm (SIGALRM, one shot) is meant to land in the test's own code. Landing
# in pytest's, while it makes or logs a report (a failure's traceback took minutes to format in
# a loaded VM), it is an INTERNALERROR that ends the whole run. The ceiling is paused for those
# hooks and resumes after with what was left (at least a second), so that it fires in the test,
# a fixture, or the next phase, each of which pytest reports as that test's failure.
def _pause_ceiling() -> float:
    left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    return left


def _resume_ceiling(left: float) -> None:
    if left > 0:
        signal.setitimer(signal.ITIMER_REAL, max(left, 1.0))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> Generator[None, Any, None]:
    left = _pause_ceiling()
    try:
        yield
    finally:
        _resume_ceiling(left)
    if report.failed and _WORKER is None:  # the progress file says which failed, as they fail
        crash = getattr(report.longrepr, "reprcrash", None)
        why = (crash.message if crash is not None else str(report.longrepr)).strip() or "?"
        _progress(f"failed {report.nodeid} ({report.when}): {why.splitlines()[0][:300]}")


# -- progress: where a run got to, for a run killed before it wrote its JUnit report -------------
# ./scripts/test names the file (NODEAGENT_KERNEL_PROGRESS, in the VM's one writable host
# directory) and reads it when the VM was killed: scripts/junit_report.py progress.
_PROGRESS = os.environ.get("NODEAGENT_KERNEL_PROGRESS")


def _progress(line: str) -> None:
    if _PROGRESS:
        with open(_PROGRESS, "a", encoding="utf-8") as out:
            out.write(line + "\n")


# Under pytest-xdist (./scripts/test runs the suite in two workers) the controller writes it: the
# workers' own hooks would write every line twice. xdist names each worker in its environment.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
# xdist gives its workers COLUMNS=80 (and LINES): the CLI would fit its tables to 80 columns and
# cut the long sandbox paths the tests look for. A test reads the CLI's output as a pipe's, whole
# lines, as in a serial run.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


# -- the operator's directories, as mount points ---------------------------------------------------
# test_service and test_package mount tmpfs (and the package's venv) over these paths inside their
# systemd's mount namespace. Each worker has a systemd of its own, but the directory under the
# mount is one, in the VM's /etc: when one module removed the directory it had made, the kernel
# detached the other worker's mount on it (rmdir of a mount point in another mount namespace,
# Linux >= 3.18) and that test's policy file vanished ("/etc/nodeagent/policy.yaml:1:1: cannot
# read: No such file or directory", CI at 14ef422). So the run makes them before any test and
# removes them after the last, once (the controller, or a serial run); the modules only mount.
MOUNT_POINTS = ("/etc/nodeagent", "/var/lib/nodeagent", "/opt/venvs/nodeagent")
_made_mount_points: list[Path] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    if _WORKER is not None or environment_problem() is not None:
        return
    for name in MOUNT_POINTS:
        path = Path(name)
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        _made_mount_points.extend(sorted(missing, key=lambda p: len(p.parts), reverse=True))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for path in _made_mount_points:  # deepest first
        with contextlib.suppress(OSError):
            path.rmdir()
    _made_mount_points.clear()


def pytest_collection_finish(session: pytest.Session) -> None:
    if _WORKER is None:  # a serial run; xdist's controller collects nothing itself
        _progress(f"collected {len(session.items)}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    if node.gateway.id == "gw0":  # every worker collects the same tests
        _progress(f"collected {len(ids)}")


def pytest_runtest_logstart(nodeid: str) -> None:
    if _WORKER is None:
        _progress(f"start {time.time():.1f} {nodeid}")


def pytest_runtest_logfinish(nodeid: str) -> None:
    if _WORKER is None:
        _progress(f"end {nodeid}")


# -- two workers: test_service.py beside the rest --------------------------------------------------
# ./scripts/test runs the suite in two pytest-xdist workers: the VM's two CPUs run two emulated
# processes at twice the rate of one (MTTCG), and most tests wait on ticks and daemons with one
# CPU idle. test_service.py, a third of the suite's time (agents started and stopped under a real
# systemd, each start a minute of Python start-up under TCG), runs in one worker with a systemd of
# its own, with the other modules OWN_WORKER names (they share no daemon set with any other
# module; they run first, as plain modules do); every other module runs in the other, in the
# order pytest_collection_modifyitems gives them, so that each shared daemon set (the runtimes,
# the other systemd) has all its users in one worker and starts and stops there as in a serial run.
#
# Some figures need the VM's CPUs to themselves: a 2:1 split measured within 10%, stalls that must
# end for a throttle to be lifted, a cgroup busy enough to be throttled. Run beside the other
# worker (Python starting under TCG, an agent ticking), they failed. Those modules (ALONE) run
# first, in the second worker, and the first worker starts its first test only once they are
# done (a run with two workers and ALONE tests among those collected; one worker runs them first
# too, and waits for nothing).
OWN_WORKER = (
    "tests/kernel/test_service.py",
    # and modules that start no shared daemon set (run before it, as plain modules are), so
    # that the two workers end together: without them the other worker ran about 1,720 s of
    # tests, this one 1,370 s (the wait for the ALONE tests included); with the Python code in
    # the guest's RAM test_service takes about 970 s, and test_api came here too (the other
    # worker ran about 1,420 s, this one 1,220 s); then test_declared_deadlines (34 s), as 13.2's
    # test took 25 s less (in fc13, 1,393 s of the other's against 1,354 s of this one's); then
    # test_gpu_check (75 s; in fc19 this worker's tests took 1,102 s and the ALONE wait 63 s,
    # the other's 1,270 s with it); then test_package, when it took the package through
    # install, upgrade, removal and purge (300 s, 80 s before; it shares test_service's
    # systemd), in place of test_gpu_check (125 s with its six steps): by fc21's figures
    # about 1,140 s of tests here and 1,060 s there
    "tests/kernel/test_exec_gpus.py",
    "tests/kernel/test_api_abuse.py",
    "tests/kernel/test_api.py",
    "tests/kernel/test_declared_deadlines.py",
    "tests/kernel/test_package.py",
)
ALONE = (  # (test_hierarchy's measured split is in the nightly tier, which runs in one worker)
    "tests/kernel/test_protection.py",
    "tests/kernel/test_metrics.py",  # a busy cgroup capped at 0.5 CPU must be throttled
)
ALONE_WAIT_S = 600
"""How long a test waits for the ALONE tests to end before it fails saying so."""
_alone_last: list[str] = []
"""The last ALONE test of the run, once collected: its teardown lets the other worker go."""


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _alone_done_path(config: pytest.Config) -> Path | None:
    """The file that says the ALONE tests are done, one per run (both workers share the VM's
    /tmp); None without workers."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    return Path(f"/tmp/nodeagent-alone-{workerinput['testrunuid']}")


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures: nothing of it starts meanwhile
def pytest_runtest_setup(item: pytest.Item) -> None:
    done = _alone_done_path(item.config)
    if done is None or not _alone_last or _module(item.nodeid) in ALONE:
        return
    deadline = time.monotonic() + ALONE_WAIT_S
    while not done.exists():
        if time.monotonic() > deadline:
            pytest.fail(
                f"waited {ALONE_WAIT_S} s for the tests that need the CPUs alone"
                f" ({', '.join(ALONE)}) to end, in the other worker",
                pytrace=False,
            )
        time.sleep(1)


def _alone_ended(item: pytest.Item) -> None:
    done = _alone_done_path(item.config)
    if done is not None and _alone_last == [item.nodeid]:
        done.touch()


def _worker_group(nodeid: str) -> str:
    return "its own" if _module(nodeid) in OWN_WORKER else "the rest"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _worker_group(nodeid)

    return ByWorkerGroup(config, log)


def enable_controllers(cgroup: Path, controllers: tuple[str, ...] = REQUIRED_CONTROLLERS) -> None:
    """Enable ``controllers`` in ``cgroup``'s cgroup.subtree_control, where not already enabled."""
    control = cgroup / "cgroup.subtree_control"
    enabled = control.read_text().split()
    for controller in controllers:
        if controller not in enabled:
            control.write_text(f"+{controller}")


def _cgroup_dirs_bottom_up(top: Path) -> list[Path]:
    return [Path(dirpath) for dirpath, _, _ in os.walk(top, topdown=False)]


def _kill_everything_in(top: Path) -> None:
    kill_file = top / "cgroup.kill"
    if kill_file.exists():  # Linux >= 5.14: one write kills the whole subtree
        kill_file.write_text("1")
        return
    for cgroup in _cgroup_dirs_bottom_up(top):
        try:
            pids = (cgroup / "cgroup.procs").read_text().split()
        except FileNotFoundError:
            continue
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def remove_cgroup_tree(top: Path, timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """Kill every process in ``top`` and its descendants, then rmdir the tree bottom-up.

    Retries while the killed processes die; raises if the tree is still there after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while top.exists():
        _kill_everything_in(top)
        try:
            for cgroup in _cgroup_dirs_bottom_up(top):
                with contextlib.suppress(FileNotFoundError):
                    cgroup.rmdir()
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise RuntimeError(f"could not remove the test cgroup {top}: {exc}") from exc
            time.sleep(0.05)


def new_sandbox_path() -> Path:
    """Create and return a fresh, uniquely named cgroup under the root (not yet configured)."""
    while True:
        path = CGROUP_ROOT / f"{SANDBOX_PREFIX}-{os.getpid()}-{next(_sandbox_numbers)}"
        try:
            path.mkdir()
        except FileExistsError:  # left over from an earlier run with the same pid
            continue
        return path


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """Mount points a test made (helpers.bind, helpers.mount_tmpfs); unmounted after it, last
    first, before its sandbox is removed."""
    made: list[Path] = []
    yield made
    for target in reversed(made):
        subprocess.run(["umount", str(target)], check=False, timeout=60)


@pytest.fixture
def cgroup_sandbox() -> Iterator[Path]:
    """A fresh cgroup under the cgroup2 root with +cpu +memory for its children; removed after."""
    enable_controllers(CGROUP_ROOT)
    sandbox = new_sandbox_path()
    try:
        enable_controllers(sandbox)
        yield sandbox
    finally:
        remove_cgroup_tree(sandbox)


# -- daemons shared between tests: a real systemd, the container runtimes -----------------------
# Each is started once, by the first test that uses it, and stopped right after the last one, so
# that the tests that do not use it neither wait for it nor run beside it (an idle dockerd or
# systemd still takes CPU from the split measurements under TCG). Their users run together: at
# collection the modules are put in the order plain, runtimes (cgroupfs), runtimes with systemd,
# systemd alone, each group in file order. The first user of each pays its start within its
# ceiling: SHARED_START_S is added to it.
SHARED_START_S = {"systemd_host": 240, "cgroupfs_runtimes": 450, "systemd_runtimes": 450}
"""Seconds each shared daemon set may take to start (a slow TCG boot included)."""
_RUNTIMES = ("cgroupfs_runtimes", "systemd_runtimes")
_shared: dict[str, contextlib.ExitStack] = {}
"""The started ones, in start order: each stack stops its daemons."""
_last_user: dict[str, str] = {}
_systemd: dict[str, Any] = {}


def _group(uses: set[str]) -> int:
    """Where a module's tests run: 0 plain, 1 runtimes, 2 runtimes and systemd, 3 systemd."""
    systemd = "systemd_host" in uses
    runtimes = any(name in uses for name in _RUNTIMES)
    return (2 if runtimes else 3) if systemd else int(runtimes)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the last user is one that runs
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    modules: dict[Any, set[str]] = {}
    for item in items:
        modules.setdefault(item.path, set()).update(getattr(item, "fixturenames", ()))
    # stable: file order within; the ALONE modules first (see above)
    items.sort(key=lambda i: (_module(i.nodeid) not in ALONE, _group(modules[i.path])))
    _alone_last[:] = [i.nodeid for i in items if _module(i.nodeid) in ALONE][-1:]
    _last_user.clear()
    for item in items:
        for name in SHARED_START_S:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid
    _ceil_every_test(items)


def _stop_shared(name: str) -> None:
    stack = _shared.pop(name, None)
    if stack is not None:
        stack.close()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    for name in reversed(list(_shared)):  # the runtimes under systemd before systemd
        if _last_user.get(name) == item.nodeid:
            _stop_shared(name)
    _alone_ended(item)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    host = _systemd.get("host")
    if host is not None:
        terminalreporter.write_line(
            f"test systemd: running {host.boot_seconds:.1f} s after the start of its boot,"
            f" stopped in {host.stop_seconds:.1f} s"
        )


@pytest.fixture(scope="session")
def systemd_host() -> Iterator[Any]:
    """A real systemd (PID 1 of its own namespaces, cgroup root below /sys/fs/cgroup), ``running``.

    See systemd_host.py for what it is and how to reach it. A boot that fails fails every test
    that uses it with one line of reason and the journal's tail.
    """
    from systemd_host import SystemdHostError, boot

    problem = None
    try:
        _systemd["host"] = host = boot()
    except SystemdHostError as exc:
        problem = str(exc)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    _shared["systemd_host"] = stack = contextlib.ExitStack()
    stack.callback(host.stop)
    try:
        yield host
    finally:
        _stop_shared("systemd_host")


@pytest.fixture(scope="session")
def cgroupfs_runtimes() -> Iterator[Any]:
    """containerd, dockerd and podman under the cgroupfs driver, processes of the VM
    (runtimes.py), started once for the run; each user removes what it started."""
    import runtimes as rt

    yield from _runtimes("cgroupfs_runtimes", lambda: rt.started(rt.InVm(), CGROUP_ROOT))


@pytest.fixture(scope="session")
def systemd_runtimes(systemd_host: Any) -> Iterator[Any]:
    """The same under the systemd driver, units of the test systemd (runtimes.py)."""
    import runtimes as rt

    def start() -> contextlib.AbstractContextManager[Any]:
        return rt.started(rt.InSystemd(systemd_host), systemd_host.cgroup)

    yield from _runtimes("systemd_runtimes", start)


def _runtimes(name: str, start: Any) -> Iterator[Any]:
    stack = contextlib.ExitStack()
    runtimes = stack.enter_context(start())
    took = ", ".join(f"{k} {v:.1f} s" for k, v in runtimes.started.items())
    print(f"\nruntimes ({runtimes.driver}) answering after: {took}")
    _shared[name] = stack
    try:
        yield runtimes
    finally:
        _stop_shared(name)


PINNED_CPUS = 2
"""The CPUs the CPU-split tests run on, whatever the host has: they need CPUs that compete."""


@pytest.fixture
def two_cpus(cgroup_sandbox: Path) -> float:
    """Confine the sandbox, and so every process in it, to two CPUs with a cpuset (the first
    two this process may run on), so that busy processes compete as they do in the 2-CPU VM
    on any host. Returns what the policy's `node.reserved_cpu` must be for the agent to plan
    on those two: the node's other CPUs (the agent counts every CPU of the node)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < PINNED_CPUS:
        pytest.fail(f"the CPU-split tests need {PINNED_CPUS} CPUs, this host gives {allowed}")
    enable_controllers(CGROUP_ROOT, ("cpuset",))
    (cgroup_sandbox / "cpuset.cpus").write_text(",".join(map(str, allowed[:PINNED_CPUS])))
    effective = parse_cpulist((cgroup_sandbox / "cpuset.cpus.effective").read_text().strip())
    assert effective == tuple(allowed[:PINNED_CPUS]), effective
    return float((psutil.cpu_count() or PINNED_CPUS) - PINNED_CPUS)


@pytest.fixture
def managed(cgroup_sandbox: Path) -> str:
    """The managed root inside this test's sandbox, relative to the cgroup root; the agent
    makes it."""
    return str(cgroup_sandbox.relative_to(CGROUP_ROOT)) + "/managed"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test started; killed and reaped after it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
    for p in started:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {p.pid} {p.args!r} still there 30 s after SIGKILL")
