"""SIGHUP reload: a bad policy file is reported and the last good policy stays in force.

The agent is built over an empty fixture directory; reload touches no cgroup.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog
from click.testing import CliRunner

from nodeagent import state
from nodeagent.act import Outcome, WriteResult
from nodeagent.api.answers import Status
from nodeagent.api.peer import Peer
from nodeagent.api.server import Request
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute
from nodeagent.cli import main
from nodeagent.daemon import Agent, open_agent
from nodeagent.errors import NodeagentError
from nodeagent.metrics.collector import TickCollector
from nodeagent.persistence import Journalled
from nodeagent.policyfile.load import load_policy
from nodeagent.runtimes.cri import CriAdapter
from nodeagent.runtimes.docker import DockerAdapter

ROOT = Peer(pid=3000, uid=0, gid=0, groups=frozenset())

GOOD = """\
version: 1
agent:
  state_file: {state}
tenants:
  research: {{shares: 2}}
"""


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD.format(state=tmp_path / "state.json"))
    return path


def make_agent(policy_file: Path, tmp_path: Path) -> Agent:
    cgroups = tmp_path / "cgroup"
    cgroups.mkdir()
    return open_agent(
        load_policy(policy_file),
        CgroupTree(str(cgroups)),
        dry_run=True,
        config_path=str(policy_file),
    )


def test_a_bad_file_keeps_the_last_good_policy(policy_file: Path, tmp_path: Path) -> None:
    agent = make_agent(policy_file, tmp_path)
    before = agent.rec.spec
    policy_file.write_text("version: 1\ntenants:\n  research: {shares: -2}\n")
    with structlog.testing.capture_logs() as logs:
        agent.reload()
    assert agent.rec.spec is before
    problems = [e["problem"] for e in logs if e["event"] == "policy.invalid"]
    assert problems == [
        f"{policy_file}:3:22: tenants.research.shares: must be greater than or equal to 0.001"
        " and less than or equal to 1000000, got -2"
    ]


def test_a_good_file_replaces_the_policy(policy_file: Path, tmp_path: Path) -> None:
    agent = make_agent(policy_file, tmp_path)
    policy_file.write_text(GOOD.format(state=tmp_path / "state.json") + "  prod: {shares: 1}\n")
    agent.reload()
    assert set(agent.rec.spec.tenants) == {"research", "prod"}


def test_moving_the_managed_root_needs_a_restart(policy_file: Path, tmp_path: Path) -> None:
    agent = make_agent(policy_file, tmp_path)
    policy_file.write_text(policy_file.read_text() + "  prod: {shares: 1}\n")
    text = policy_file.read_text().replace("agent:\n", "agent:\n  managed_root: elsewhere.slice\n")
    policy_file.write_text(text)
    with structlog.testing.capture_logs() as logs:
        agent.reload()
    assert set(agent.rec.spec.tenants) == {"research"}
    assert [e["changed"] for e in logs if e["event"] == "policy.needs_restart"] == [
        ["agent.managed_root"]
    ]


def test_command_line_overrides_survive_a_reload(policy_file: Path, tmp_path: Path) -> None:
    cgroups = tmp_path / "cgroup"
    cgroups.mkdir()
    agent = open_agent(
        load_policy(policy_file),
        CgroupTree(str(cgroups)),
        dry_run=True,
        config_path=str(policy_file),
        overrides={"interval": 0.2},
    )
    assert agent.rec.spec.agent.interval == 0.2
    policy_file.write_text(policy_file.read_text() + "  prod: {shares: 1}\n")
    agent.reload()
    assert set(agent.rec.spec.tenants) == {"research", "prod"}
    assert agent.rec.spec.agent.interval == 0.2


def test_run_once_reports_a_failed_tick(
    policy_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nodeagent run --once` exits with this: a tick that failed is not a success."""
    agent = make_agent(policy_file, tmp_path)

    def broken() -> None:
        raise OSError("no /proc/stat")

    monkeypatch.setattr(agent, "tick", broken)
    assert agent.run(once=True) is False
    monkeypatch.undo()
    assert agent.run(once=True) is True


def test_a_bad_override_is_refused_like_a_bad_file(policy_file: Path, tmp_path: Path) -> None:
    with pytest.raises(NodeagentError, match=r"^--state-file: must be an absolute path"):
        open_agent(
            load_policy(policy_file),
            CgroupTree(str(tmp_path)),
            dry_run=True,
            overrides={"state_file": "relative/state.json"},
        )


def test_a_reload_that_drops_a_tenant_drops_its_history(policy_file: Path, tmp_path: Path) -> None:
    """Kept while the tenant is in the policy; after a reload without it, gone from the
    history and from the saved state, while the other tenant's history stays."""
    policy_file.write_text(policy_file.read_text() + "  gone: {shares: 1}\n")
    agent = make_agent(policy_file, tmp_path)
    agent.rec.feedback = replace(agent.rec.feedback, usage={"research": 5.0, "gone": 7.0})
    agent.tick()
    assert agent.rec.feedback.usage == pytest.approx({"research": 5.0, "gone": 7.0}, rel=1e-3)
    policy_file.write_text(GOOD.format(state=tmp_path / "state.json"))
    agent.reload()
    agent.tick()
    assert agent.rec.feedback.usage == pytest.approx({"research": 5.0}, rel=1e-3)
    agent.save_state()
    saved = state.load(str(tmp_path / "state.json"))
    assert saved is not None and saved.tenant_usage == agent.rec.feedback.usage


def test_a_fast_path_write_to_a_cgroup_gone_by_the_tick_is_reported_not_fatal(
    policy_file: Path, tmp_path: Path
) -> None:
    """The fast path's writes are reported with the next tick, whose plan may no longer
    hold their cgroup (it went in between: routine under churn). That tick must not fail."""
    agent = make_agent(policy_file, tmp_path)
    gone = WriteResult("nodeagent.slice/w-0", Attribute.CPU_MAX, "max 100000",
                       "50000 100000", "rule r: cpu_max 0.5 cores", Outcome.WRITTEN)  # fmt: skip
    agent.rec._fast_results = [gone]
    record = agent.tick()
    assert gone in record.results
    assert agent.tick().results == ()  # reported once


def test_a_first_change_is_saved_with_its_original_at_once_and_restored(
    policy_file: Path, tmp_path: Path
) -> None:
    """tuned's 'old value recorded': the tick that first changes an attribute records the
    value it replaced at once, for `nodeagent release` (issue 13, item 4), on the state's
    journal: a line each, not a save of the whole file (which grows with the node, and made
    each newcomer's writes wait on the last one's save); a restarted agent keeps the record
    of the cgroups that still exist, and the next save folds the journal into the file."""
    cgroups = tmp_path / "cgroup"
    (cgroups / "system.slice" / "x.scope").mkdir(parents=True)
    agent = open_agent(
        load_policy(policy_file), CgroupTree(str(cgroups)), config_path=str(policy_file)
    )
    wrote = [
        WriteResult("system.slice/x.scope", Attribute.FREEZE, "0", "1", "freeze", Outcome.WRITTEN),
        WriteResult("nodeagent.slice/gone", Attribute.CPU_MAX, "max 100000", "1000 100000", "cap",
                    Outcome.WRITTEN),
        WriteResult("system.slice/x.scope", Attribute.CPU_WEIGHT, "100", "9", "w", Outcome.FAILED),
    ]  # fmt: skip
    agent.rec.record_originals(wrote, SimpleNamespace(cgroups=[]))  # type: ignore[arg-type]
    file = tmp_path / "state.json"
    assert not file.exists()
    assert len(Path(state.journal_path(str(file))).read_text().splitlines()) == 2
    agent.rec.record_originals(wrote[:1], SimpleNamespace(cgroups=[]))  # type: ignore[arg-type]
    assert len(Path(state.journal_path(str(file))).read_text().splitlines()) == 2  # known
    saved = state.load(str(file))
    assert saved is not None
    assert saved.originals == {
        "nodeagent.slice/gone": {
            "cpu.max": {"was": "max 100000", "set": "1000 100000", "via": "direct"}
        },
        "system.slice/x.scope": {"cgroup.freeze": {"was": "0", "set": "1", "via": "systemd"}},
    }
    again = open_agent(
        load_policy(policy_file), CgroupTree(str(cgroups)), config_path=str(policy_file)
    )
    assert [(p, str(a)) for p, a, _ in again.rec.originals.items()] == [
        ("system.slice/x.scope", "cgroup.freeze")
    ]
    again.save_state()
    assert not Path(state.journal_path(str(file))).exists()
    assert state.load(str(file)).originals == {  # type: ignore[union-attr]
        "system.slice/x.scope": {"cgroup.freeze": {"was": "0", "set": "1", "via": "systemd"}},
    }


CAPPED = (
    GOOD
    + """\
rules:
  - name: capped
    match: {{path: nodeagent.slice/*}}
    tenant: research
    limits: {{cpu_max: 0.5}}
"""
)


def test_a_tick_due_to_save_saves_its_first_changes_whole_and_journals_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first tick writes every attribute the policy sets: thousands of first changes on a
    big node. Journalled line by line and then saved whole at the tick's end, they cost the
    first tick twice (and the first newcomer waited on the save). A tick whose save is due
    saves them once, whole, and journals nothing; one that is not due journals them, as the
    fast path always does."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(CAPPED.format(state=tmp_path / "state.json"))
    cgroups = tmp_path / "cgroup"
    for name in ("a", "b", "c"):
        d = cgroups / "nodeagent.slice" / name
        d.mkdir(parents=True)
        for f, text in {"cgroup.procs": "", "cpu.max": "max 100000\n", "cpu.weight": "100\n",
                        "cpu.stat": "usage_usec 0\n"}.items():  # fmt: skip
            (d / f).write_text(text)
    agent = open_agent(load_policy(policy), CgroupTree(str(cgroups)), config_path=str(policy))
    appended: list[int] = []
    real_append = state.append_originals

    def counting(path: str, fresh: Journalled) -> None:
        appended.append(len(fresh))
        real_append(path, fresh)

    monkeypatch.setattr(state, "append_originals", counting)
    file = tmp_path / "state.json"
    journal = Path(state.journal_path(str(file)))
    agent.rec.registry.resync()  # what prepare() does but make the managed root
    record = agent.tick()
    capped = sorted(r.path for r in record.results if r.attribute is Attribute.CPU_MAX)
    assert capped == ["nodeagent.slice/a", "nodeagent.slice/b", "nodeagent.slice/c"]
    assert appended == []  # saved whole, once
    assert not journal.exists()
    saved = state.load(str(file))
    assert saved is not None
    assert sorted(saved.originals) == capped
    assert not agent.rec.saver.due()
    later = [WriteResult("nodeagent.slice/c", Attribute.CPU_WEIGHT, "100", "50", "w",
                         Outcome.WRITTEN)]  # fmt: skip
    agent.rec.record_originals(later, SimpleNamespace(cgroups=[]), tick=True)  # type: ignore[arg-type]
    assert appended == [1]  # not due: journalled
    assert len(journal.read_text().splitlines()) == 1
    again = open_agent(load_policy(policy), CgroupTree(str(cgroups)), config_path=str(policy))
    assert sorted((p, str(a)) for p, a, _ in again.rec.originals.items()) == [
        ("nodeagent.slice/a", "cpu.max"),
        ("nodeagent.slice/b", "cpu.max"),
        ("nodeagent.slice/c", "cpu.max"),
        ("nodeagent.slice/c", "cpu.weight"),
    ]


RESTART_ONLY = {
    # the field as the refusal names it: what the reloaded file says of it
    "agent.socket": ("agent", "socket: {tmp}/elsewhere.sock"),
    "agent.socket_group": ("agent", "socket_group: wheel"),
    "agent.metrics": ("agent", "metrics: {{listen: 127.0.0.1:9464}}"),
    "agent.mode": ("agent", "mode: kubernetes"),
    "gpu.simulate": ("gpu", "simulate: {tmp}/gpus.yaml"),
    "kubernetes.node_name": ("kubernetes", "node_name: node-1"),
    "kubernetes.pod_resources_socket": ("kubernetes", "pod_resources_socket: {tmp}/k.sock"),
    "kubernetes.pod_resources_timeout": ("kubernetes", "pod_resources_timeout: 5"),
    "kubernetes.api_server": ("kubernetes", "api_server: {{watch: true}}"),
}


def with_setting(tmp_path: Path, section: str, line: str) -> str:
    """The good file with a tenant more (applied only if the reload is) and `line` set in
    `section`."""
    text = GOOD.format(state=tmp_path / "state.json") + "  prod: {shares: 1}\n"
    line = line.format(tmp=tmp_path)
    if section == "agent":
        return text.replace("agent:\n", f"agent:\n  {line}\n")
    return text + f"{section}:\n  {line}\n"


def reload_metric(agent: Agent) -> float:
    """nodeagent_config_last_reload_successful as a scrape would show it now."""
    collector = TickCollector(reload=lambda: agent.last_reload)
    [value] = [
        s.value
        for family in collector.collect()
        for s in family.samples
        if s.name == "nodeagent_config_last_reload_successful"
    ]
    return value


def test_the_metrics_and_status_tell_one_story_of_the_reloads(
    policy_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the metrics show (`last_reload`) and /v1/status's policy_loaded come from the one
    outcome and load time the agent keeps: at the start (a load that applied), after a
    reload that raised (a bug: said, then raised), one refused and one applied."""
    agent = make_agent(policy_file, tmp_path)
    status = agent.routes()["/v1/status"]["GET"]

    def loaded() -> object:
        answer = status(Request("GET", "/v1/status", {}, ROOT))
        assert isinstance(answer, Status)
        return answer.policy_loaded

    start = agent.started
    assert (agent.last_reload, loaded(), agent.reload_outcome) == ((True, start), start, None)
    good = GOOD.format(state=tmp_path / "state.json") + "  prod: {shares: 1}\n"
    policy_file.write_text(good)

    def broken(spec: object) -> None:
        raise RuntimeError("a bug")

    with monkeypatch.context() as m:
        m.setattr(agent.rec, "reloaded", broken)
        with pytest.raises(RuntimeError, match="a bug"):
            agent.reload()
    assert agent.reload_outcome is not None
    assert agent.reload_outcome.problems == (f"{policy_file}: RuntimeError: a bug",)
    assert (agent.last_reload, loaded()) == ((False, start), start)
    policy_file.write_text("version: 1\ntenants:\n  research: {shares: -2}\n")
    refused = agent.reload()
    assert refused is not None and not refused.applied
    assert (agent.last_reload, loaded()) == ((False, start), start)
    policy_file.write_text(good)
    applied = agent.reload()
    assert applied is not None and applied.applied and applied.at >= start
    assert (agent.last_reload, loaded()) == ((True, applied.at), applied.at)


@pytest.mark.parametrize("field", sorted(RESTART_ONLY))
def test_a_reload_that_changes_what_is_read_at_start_is_refused_whole(
    field: str, policy_file: Path, tmp_path: Path
) -> None:
    """Each field used once at start (a socket bound, the GPU backend opened, a Kubernetes
    client made): a reload that changes it is refused in one line naming that field, and
    nothing of the file applies (not even its other, reloadable changes: the new tenant);
    the metrics say the last reload failed, and when the policy in force was loaded."""
    agent = make_agent(policy_file, tmp_path)
    before, loaded_at = agent.rec.spec, agent.last_reload[1]
    assert reload_metric(agent) == 1
    policy_file.write_text(with_setting(tmp_path, *RESTART_ONLY[field]))
    with structlog.testing.capture_logs() as logs:
        agent.reload()
    assert [(e["event"], e.get("changed")) for e in logs] == [("policy.needs_restart", [field])]
    assert agent.rec.spec is before
    assert agent.last_reload == (False, loaded_at)
    assert reload_metric(agent) == 0
    # the file put back as it was loaded: the next reload applies again
    policy_file.write_text(GOOD.format(state=tmp_path / "state.json") + "  prod: {shares: 1}\n")
    agent.reload()
    assert set(agent.rec.spec.tenants) == {"research", "prod"} and reload_metric(agent) == 1


def test_turning_on_the_topology_publisher_needs_a_restart(
    policy_file: Path, tmp_path: Path
) -> None:
    """In Kubernetes mode (needs a restart itself) the API server's client is made at start
    only if the policy publishes a NodeResourceTopology or watches the API server: a reload
    that turns publishing on would publish through no client."""
    node = with_setting(tmp_path, "agent", "mode: kubernetes") + "kubernetes:\n  node_name: n1\n"
    policy_file.write_text(node)
    agent = make_agent(policy_file, tmp_path)
    before = agent.rec.spec
    policy_file.write_text(node + "publish:\n  node_resource_topology: true\n")
    with structlog.testing.capture_logs() as logs:
        agent.reload()
    assert [(e["event"], e.get("changed")) for e in logs] == [
        ("policy.needs_restart", ["publish.node_resource_topology"])
    ]
    assert agent.rec.spec is before


def test_a_reload_that_moves_a_runtime_s_socket_reopens_the_runtimes(
    policy_file: Path, tmp_path: Path
) -> None:
    """The adapters were made for the old sockets: a reload that moves one closes them all
    and asks the new sockets from then on; one that leaves the runtimes' settings alone
    keeps the adapters (and what they learned) as they are."""
    agent = make_agent(policy_file, tmp_path)
    old = agent.rec.runtimes
    closed: list[str] = []

    def closing(name: str) -> Callable[[], None]:
        return lambda: closed.append(name)

    for name, adapter in old.adapters.items():
        adapter.close = closing(name)  # type: ignore[method-assign]
    policy_file.write_text(with_setting(tmp_path, "agent", "reload_on_change: true"))
    agent.reload()
    assert agent.rec.spec.agent.reload_on_change and agent.rec.runtimes is old and closed == []
    moved = "runtimes: {{docker: {tmp}/docker.sock, containerd: null, timeout: 1}}"
    policy_file.write_text(with_setting(tmp_path, "agent", moved))
    agent.reload()
    assert sorted(closed) == sorted(old.adapters)
    new = agent.rec.runtimes
    assert new is not old and agent.rec.runtimes is new
    assert sorted(new.adapters) == ["crio", "docker", "podman"]
    docker = new.adapters["docker"]
    assert isinstance(docker, DockerAdapter)
    assert (docker.socket, docker.timeout) == (f"{tmp_path}/docker.sock", 1)
    crio = new.adapters["crio"]
    assert isinstance(crio, CriAdapter) and crio.timeout == 1


def policy_metric(agent: Agent) -> str:
    """nodeagent_policy_info's sha256 as a scrape would show it now."""
    collector = TickCollector(policy=lambda: agent.policy_sha256)
    [sha256] = [
        s.labels["sha256"]
        for family in collector.collect()
        for s in family.samples
        if s.name == "nodeagent_policy_info"
    ]
    return sha256


def test_the_policy_in_force_is_named_by_its_sha256_as_validate_names_the_file(
    policy_file: Path, tmp_path: Path
) -> None:
    """A fleet sees which nodes run which policy (a canary pool's, the last one): the
    metric and the status name the policy in force by the digest `validate --json` prints
    for the file; a reload that applies changes it, one refused leaves it, and a change of
    comments or layout alone does not."""
    agent = make_agent(policy_file, tmp_path)

    def validated() -> str:
        out = CliRunner().invoke(main, ["validate", "--json", str(policy_file)]).output
        return str(json.loads(out)["sha256"])

    first = validated()
    assert len(first) == 64 and policy_metric(agent) == first == agent.policy_sha256
    policy_file.write_text("# a comment\n" + policy_file.read_text().replace(": ", ":  "))
    assert validated() == first, "comments and layout are not the policy"
    policy_file.write_text(with_setting(tmp_path, "agent", "socket: {tmp}/other.sock"))
    agent.reload()
    assert policy_metric(agent) == first, "a refused reload leaves the policy in force"
    policy_file.write_text(GOOD.format(state=tmp_path / "state.json") + "  prod: {shares: 1}\n")
    agent.reload()
    assert policy_metric(agent) == validated() != first
