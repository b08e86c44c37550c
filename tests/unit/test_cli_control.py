"""`nodeagent reload` and `nodeagent status` against a running daemon (issue 36, items 4, 5).

The daemon is the real loop (dry run, on a plain directory as its cgroup root) in a thread,
serving its own routes on a real Unix socket; the CLI is the installed console script, as
the unit's ExecReload= and an operator run it. The callers' credentials are set on each
request as SO_PEERCRED would give them (root unless a test says otherwise), so that the
tests hold whoever runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from test_daemon_reload import reload_metric

from nodeagent import __version__
from nodeagent.api.answers import PeerState, RuntimeState, Status
from nodeagent.api.peer import Peer
from nodeagent.api.server import ApiServer, Handler, Request, Routes
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cli.control import daemon_socket, status_text
from nodeagent.daemon import Agent, open_agent
from nodeagent.errors import BadRequest, Conflict, Forbidden
from nodeagent.policyfile.listen import DEFAULT_SOCKET
from nodeagent.policyfile.load import load_policy
from nodeagent.reloads import Reload
from nodeagent.routes.agent import problems

REPO = Path(__file__).resolve().parents[2]
ROOT = Peer(pid=3000, uid=0, gid=0, groups=frozenset())
ALICE = Peer(pid=4000, uid=1000, gid=1000, groups=frozenset({1000}))
POLICY = """\
version: 1
agent:
  interval: 0.05
  state_file: {state}
  socket: {socket}
tenants:
  research: {{shares: 2}}
"""
BAD_SHARES = "  prod: {shares: -2}\n"
"""A tenant line that makes the file invalid, at line 8, column 18."""


def nodeagent(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script (nodeagent.cli:entrypoint), as an operator runs it."""
    script = Path(sys.executable).parent / "nodeagent"
    command = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "from nodeagent.cli import entrypoint; entrypoint()"]
    )
    environ = {k: v for k, v in os.environ.items() if k not in ("NODEAGENT_SOCKET", "COLUMNS")}
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, cwd=REPO, env=environ, check=False
    )


def as_peer(routes: Routes, peer: Callable[[], Peer]) -> Routes:
    """`routes` with each request's caller replaced by `peer()`."""

    def wrap(handler: Handler) -> Handler:
        return lambda request: handler(replace(request, peer=peer()))

    return {path: {m: wrap(h) for m, h in methods.items()} for path, methods in routes.items()}


@dataclass
class Running:
    agent: Agent
    policy: Path
    socket: str
    caller: list[Peer]
    """Who the daemon sees calling: the first."""
    loop: list[int]
    """The loop thread's ident, once it runs."""

    def text(self, tenants: str = "") -> str:
        return POLICY.format(state=self.policy.parent / "state.json", socket=self.socket) + tenants


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    sockdir = Path(tempfile.mkdtemp(prefix="nodeagent-ctl-"))  # short: a socket path's limit
    sock = str(sockdir / "api.sock")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(state=tmp_path / "state.json", socket=sock))
    (tmp_path / "cgroup").mkdir()
    agent = open_agent(
        load_policy(policy), CgroupTree(str(tmp_path / "cgroup")), dry_run=True,
        config_path=str(policy),
    )  # fmt: skip
    state = Running(agent, policy, sock, [ROOT], [])

    def loop() -> None:
        state.loop.append(threading.get_ident())
        agent.run()

    server = ApiServer(sock, as_peer(agent.routes(), lambda: state.caller[0]))
    server.start()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: agent.rec.last is not None), "the loop's first tick"
        yield state
    finally:
        agent.stop.set()
        thread.join(10)
        server.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def wait_for(check: Callable[[], bool], seconds: float = 20.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return False


# --- nodeagent reload ------------------------------------------------------------------------


def test_a_bad_file_fails_reload_with_its_problem_and_the_daemon_keeps_its_policy(
    running: Running,
) -> None:
    """What `systemctl reload` runs: the daemon itself refuses the file, so the CLI fails
    with the daemon's FILE:LINE:COL line, the policy in force stays, and the metric (whose
    alert is NodeagentConfigReloadFailed) reads 0."""
    agent, policy = running.agent, running.policy
    before = agent.rec.spec
    policy.write_text(running.text(BAD_SHARES))
    proc = nodeagent("reload", "--socket", running.socket, "--config", str(policy))
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    *problems_shown, last = proc.stderr.splitlines()
    assert problems_shown == [
        f"{policy}:8:18: tenants.prod.shares: must be greater than or equal to 0.001 and less"
        " than or equal to 1000000, got -2"
    ]
    assert last == (
        f"nodeagent: error: the daemon on {running.socket} refused the file (1 problem,"
        " above) and keeps its last good policy"
    )
    assert agent.rec.spec is before
    assert agent.last_reload[0] is False
    assert reload_metric(agent) == 0
    assert agent.reload_outcome is not None and agent.reload_outcome.problems == tuple(
        problems_shown
    )


def test_a_good_file_is_applied_on_the_loops_thread_and_reload_exits_0(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, policy = running.agent, running.policy
    threads: list[int] = []
    real = agent.reload

    def reload() -> Reload | None:
        threads.append(threading.get_ident())
        return real()

    monkeypatch.setattr(agent, "reload", reload)
    policy.write_text(running.text("  prod: {shares: 1}\n"))
    proc = nodeagent("reload", "--socket", running.socket, "--config", str(policy))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        f"{policy}: reloaded (2 tenants, 0 rules; sha256 {agent.policy_sha256[:12]})\n"
    )
    assert set(agent.rec.spec.tenants) == {"research", "prod"}
    assert threads == running.loop, "the reload ran on the loop's thread"
    assert agent.last_reload[0] is True and reload_metric(agent) == 1


def test_reload_json_says_either_outcome_on_stdout(running: Running) -> None:
    policy = running.policy
    policy.write_text(running.text(BAD_SHARES))
    proc = nodeagent("reload", "--socket", running.socket, "--json")
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["apiVersion"], doc["kind"], doc["applied"]) == (
        "nodeagent/v1",
        "PolicyReload",
        False,
    )
    assert [p.split(": ")[0] for p in doc["problems"]] == [f"{policy}:8:18"]
    policy.write_text(running.text("  prod: {shares: 1}\n"))
    proc = nodeagent("reload", "--socket", running.socket, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["applied"] is True and doc["problems"] == []
    assert (doc["file"], doc["tenants"], doc["rules"]) == (str(policy), 2, 0)
    assert doc["sha256"] == running.agent.policy_sha256


def test_config_alone_finds_the_socket_even_in_a_file_that_does_not_load(
    running: Running,
) -> None:
    """As ExecReload= runs it: no --socket, the file's agent.socket, read leniently (the
    file is the broken one whose reload is to be refused)."""
    running.policy.write_text(running.text(BAD_SHARES))
    assert daemon_socket(None, str(running.policy)) == running.socket
    proc = nodeagent("reload", "--config", str(running.policy))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"{running.policy}:8:18: ")
    assert daemon_socket(None, str(running.policy.parent / "missing.yaml")) == DEFAULT_SOCKET
    assert daemon_socket("/run/x.sock", str(running.policy)) == "/run/x.sock"


def test_reload_of_another_file_than_the_daemons_is_refused(running: Running) -> None:
    other = running.policy.parent / "other.yaml"
    other.write_text(running.text("  prod: {shares: 1}\n"))
    proc = nodeagent("reload", "--socket", running.socket, "--config", str(other))
    assert proc.returncode == 1
    assert proc.stderr == (
        f"nodeagent: error: this daemon runs with {running.policy}, not {other}: reload its"
        f" own file, or restart it with --config {other}\n"
    )
    assert set(running.agent.rec.spec.tenants) == {"research"}
    assert running.agent.reload_outcome is None, "nothing was read"


def test_only_root_may_reload(running: Running) -> None:
    running.caller[0] = ALICE
    running.policy.write_text(running.text("  prod: {shares: 1}\n"))
    proc = nodeagent("reload", "--socket", running.socket)
    assert proc.returncode == 1
    assert proc.stderr == (
        "nodeagent: error: only root may reload the daemon's policy (sudo nodeagent reload,"
        " or systemctl reload nodeagent)\n"
    )
    assert set(running.agent.rec.spec.tenants) == {"research"}


def test_reload_without_a_daemon_is_one_line(tmp_path: Path) -> None:
    sock = str(tmp_path / "none.sock")
    proc = nodeagent("reload", "--socket", sock)
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        f"nodeagent: error: no nodeagent daemon is running (nothing answers on {sock})"
    )
    assert proc.stderr.count("\n") == 1


def call(agent: Agent, peer: Peer, method: str, path: str, body: dict[str, object]) -> object:
    return agent.routes()[path][method](Request(method, path, {}, peer, body))


def test_the_route_refuses_strangers_bad_bodies_and_settings_read_at_start(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(state=tmp_path / "state.json", socket=tmp_path / "s.sock"))
    (tmp_path / "cgroup").mkdir()
    agent = open_agent(load_policy(policy), CgroupTree(str(tmp_path / "cgroup")), dry_run=True,
                       config_path=str(policy))  # fmt: skip
    with pytest.raises(Forbidden):
        call(agent, ALICE, "POST", "/v1/reload", {})
    with pytest.raises(BadRequest, match=r"^unknown field 'path'$"):
        call(agent, ROOT, "POST", "/v1/reload", {"path": "x"})
    policy.write_text(
        policy.read_text().replace("  interval:", "  managed_root: x.slice\n  interval:")
    )
    with pytest.raises(Conflict) as refused:
        call(agent, ROOT, "POST", "/v1/reload", {"file": str(policy)})
    assert str(refused.value) == (
        f"{policy}: agent.managed_root is read only at start: nothing of the file is applied;"
        " restart nodeagent to apply it (systemctl restart nodeagent)"
    )
    assert agent.last_reload[0] is False
    without = open_agent(load_policy(policy), CgroupTree(str(tmp_path / "cgroup")), dry_run=True)
    with pytest.raises(BadRequest, match="runs without a policy file"):
        call(without, ROOT, "POST", "/v1/reload", {})


# --- nodeagent status ------------------------------------------------------------------------


def test_status_text_and_json_of_a_running_daemon(running: Running) -> None:
    agent = running.agent
    proc = nodeagent("status", "--socket", running.socket)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines if str(running.policy) not in line), lines
    labels = [line[:14].rstrip() for line in lines]
    assert labels == [
        "nodeagent", "started", "policy", "sha256", "loaded", "last reload", "last tick",
        "workloads", "deadlines", "problems",
    ]  # fmt: skip
    assert lines[0] == f"nodeagent     {__version__}, pid {os.getpid()} (dry run: writes nothing)"
    assert lines[2] == f"policy        {running.policy}"
    assert lines[3] == f"sha256        {agent.policy_sha256}"
    assert lines[5] == "last reload   none since start"
    assert lines[8] == "deadlines     0 missed since the start"
    assert lines[9] == "problems      none"

    proc = nodeagent("status", "--config", str(running.policy), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["apiVersion"], doc["kind"]) == ("nodeagent/v1", "AgentStatus")
    assert (doc["version"], doc["pid"], doc["policy_file"]) == (
        __version__, os.getpid(), str(running.policy),
    )  # fmt: skip
    assert doc["policy_sha256"] == agent.policy_sha256
    assert doc["started_timestamp_seconds"] == agent.started
    assert doc["tick"] >= 1 and 0 <= doc["tick_age_seconds"] < 20
    assert doc["uptime_seconds"] >= 0 and doc["last_reload"] is None
    assert doc["problems"] == [] and doc["workloads"] == 0


def test_status_lists_a_refused_reload_and_exits_1_but_not_for_missed_deadlines(
    running: Running,
) -> None:
    """A missed deadline is counted since the start: as a problem, it would fail every
    `nodeagent status` after it until a restart."""
    agent = running.agent

    def miss() -> None:
        """On the loop's thread, as a job's end is; it publishes the count for the reads."""
        agent.rec.notes.missed("nodeagent.slice/late", 1.0)
        agent.rec.publish()

    agent.commands.call(miss)
    missed = json.loads(nodeagent("status", "--socket", running.socket, "--json").stdout)
    assert missed["deadline_misses"] == 1 and missed["problems"] == []
    assert nodeagent("status", "--socket", running.socket).returncode == 0
    running.policy.write_text(running.text(BAD_SHARES))
    assert nodeagent("reload", "--socket", running.socket).returncode == 1
    proc = nodeagent("status", "--socket", running.socket)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[5].startswith("last reload   refused ") and lines[5].endswith(
        " ago (1 problem, below)"
    )
    at = lines.index("problems      1")
    shown = "\n".join(lines[at + 1 :])
    assert shown.startswith("  - reload refused, the last good policy stays:")
    doc = json.loads(nodeagent("status", "--socket", running.socket, "--json").stdout)
    assert doc["last_reload"]["applied"] is False
    assert doc["last_reload"]["problems"][0].startswith(f"{running.policy}:8:18: ")
    assert doc["problems"][0] == (
        "reload refused, the last good policy stays: " + doc["last_reload"]["problems"][0]
    )


def test_status_without_a_daemon_is_one_line_naming_the_socket(tmp_path: Path) -> None:
    sock = str(tmp_path / "none.sock")
    proc = nodeagent("status", "--socket", sock)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        f"nodeagent: error: no nodeagent daemon is running (nothing answers on {sock}); start"
        " it with 'systemctl start nodeagent' or 'nodeagent run --config FILE'\n"
    )


OLD_STATUS = {
    "pid": 7, "dry_run": False, "policy_file": "/etc/nodeagent/policy.yaml",
    "cgroup_root": "/sys/fs/cgroup", "managed_root": "nodeagent.slice", "tick": 3,
    "workloads": 2, "slurm_problem": None, "deadline_misses": 0, "runtimes": {},
}  # fmt: skip
"""/v1/status as a daemon from before policy_sha256, peers and the fields after them."""


def test_an_older_daemons_status_still_reads() -> None:
    text = status_text(Status.model_validate(OLD_STATUS), 1000.0)
    assert text.splitlines() == [
        "nodeagent     ? (an older daemon), pid 7",
        "started       ?",
        "policy        /etc/nodeagent/policy.yaml",
        "sha256        ?",
        "loaded        ?",
        "last reload   ?",
        "last tick     3",
        "workloads     2 (managed root nodeagent.slice)",
        "deadlines     0 missed since the start",
        "problems      none",
    ]


def status(**fields: object) -> Status:
    return Status.model_validate({**OLD_STATUS, "started": 0.0, "tick_time": 95.0, **fields})


def test_problems_name_each_service_once_and_ticks_that_stopped() -> None:
    """A runtime that does not answer is said as the peer (with its address and error),
    not from `runtimes`, which lists the ones the node never had too (crio here); Slurm
    likewise; ticks are late past max(3 intervals, 30 s)."""
    docker = PeerState(name="docker", address="/run/docker.sock", up=False, since=1.0,
                       last_success=None, error="connection refused")  # fmt: skip
    runtimes = {
        "docker": RuntimeState(socket="/run/docker.sock", answering=False, problem="docker x"),
        "crio": RuntimeState(socket="/run/crio.sock", answering=False, problem=None),
        "containerd": RuntimeState(socket="/run/c.sock", answering=True, problem=None),
    }
    found = problems(
        status(peers=[docker], runtimes=runtimes, slurm_problem="squeue: not found"),
        interval=1.0,
        now=100.0,
        reload=None,
    )
    assert found == [
        "docker does not answer (/run/docker.sock): connection refused",
        "slurm: squeue: not found",
    ]
    assert problems(status(), 1.0, 125.0, None) == []
    assert problems(status(), 1.0, 126.0, None) == [
        "no tick for 31 s (agent.interval 1 s): ticks fail or hang; see tick.failed in the journal"
    ]
    assert problems(status(tick=None, tick_time=None), 20.0, 61.0, None) == [
        "no tick has completed since the start for 61 s (agent.interval 20 s): ticks fail or"
        " hang; see tick.failed in the journal"
    ]
    refused = Reload("/p.yaml", False, 90.0, ("/p.yaml:1:1: bad", "/p.yaml:2:1: worse"))
    assert problems(status(), 1.0, 100.0, refused) == [
        "reload refused, the last good policy stays: /p.yaml:1:1: bad",
        "reload refused, the last good policy stays: /p.yaml:2:1: worse",
    ]
    applied = Reload("/p.yaml", True, 90.0, rules=1, tenants=1)
    assert problems(status(), 1.0, 100.0, applied) == []


def test_agent_reload_returns_what_it_did(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    text = POLICY.format(state=tmp_path / "state.json", socket=tmp_path / "s.sock")
    policy.write_text(text)
    (tmp_path / "cgroup").mkdir()
    agent = open_agent(load_policy(policy), CgroupTree(str(tmp_path / "cgroup")), dry_run=True,
                       config_path=str(policy))  # fmt: skip
    policy.write_text(text + BAD_SHARES)
    refused = agent.reload()
    assert refused is not None and not refused.applied and refused.file == str(policy)
    assert [p.split(": ")[0] for p in refused.problems] == [f"{policy}:8:18"]
    assert agent.reload_outcome is refused and agent.last_reload[0] is False
    policy.write_text(text + "  prod: {shares: 1}\n")
    applied = agent.reload()
    assert applied is not None and applied.applied and (applied.tenants, applied.rules) == (2, 0)
    assert agent.last_reload == (True, applied.at)
