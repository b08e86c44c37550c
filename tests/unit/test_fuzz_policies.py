"""Fuzzed policies: no input gives a traceback, every rejection is FILE:LINE:COL: message,
and a reload with any of them keeps the last good policy.

10,000 policies per run (policy_fuzz.py: the example policy mutated as text and as data)
through the loader in-process; a sample through the installed `nodeagent validate` (a
process each, so fewer); and a sample through `Agent.reload`. The pytest summary says how
many ran; `pytest --hypothesis-seed N` repeats a run. The fuzzing tests are marked `fuzz`:
`FAST=1 ./scripts/test unit` (pytest -m "not fuzz") leaves them out locally; CI runs them.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import yaml
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from policy_fuzz import SEED, SEED_DATA, check_rejection, count, policies, seeded_policies, total

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.model import PolicySpec
from nodeagent.policyfile.yamlfile import PolicyError, Problem

DRAWN = 500
"""Policies whose every choice hypothesis draws: slow to make, but a failure shrinks."""
BATCHES, PER_BATCH = 960, 10
"""Seeded batches: hypothesis draws the seed, random.Random makes the policies (cheap)."""
THROUGH_CLI = 30
THROUGH_RELOAD = 500


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def parsed(text: str) -> None:
    """check_text gives a spec, or a PolicyError whose every line is located."""
    try:
        spec = check_text(text, "fuzz.yaml").spec
    except PolicyError as e:
        check_rejection(str(e), "fuzz.yaml", text)
        count("check_text", "rejected")
    else:
        assert isinstance(spec, PolicySpec)
        count("check_text", "accepted")


@pytest.mark.fuzz
def test_the_loader_accepts_or_locates_every_drawn_problem() -> None:
    before = total("check_text")
    fuzz(DRAWN)(given(policies)(parsed))()
    assert total("check_text") - before >= DRAWN


# The seeded batches in four parts, one test each: a single 2.5-minute test ran last in one
# pytest-xdist worker while the other sat idle, and two halves of 100 s each still left a
# worker idle at the end of the run.
PARTS = 4


@pytest.mark.fuzz
@pytest.mark.parametrize("part", range(PARTS))
def test_the_loader_accepts_or_locates_every_seeded_problem(part: int) -> None:
    before = total("check_text")

    @fuzz(BATCHES // PARTS)
    @given(st.integers(0, 2**63 - 1))
    def batch(seed: int) -> None:
        seed = PARTS * seed + part  # the parts draw disjoint seeds
        for n, text in enumerate(seeded_policies(seed, PER_BATCH)):
            try:
                parsed(text)
            except BaseException:
                note(f"policy {n} of seeded_policies({seed}, {PER_BATCH}): {text!r}")
                raise

    batch()
    assert total("check_text") - before >= BATCHES // PARTS * PER_BATCH


@pytest.mark.fuzz
def test_nodeagent_validate_accepts_or_locates_every_problem(tmp_path: Path) -> None:
    """The installed console script, as an operator runs it: exit 0 and 'ok', or exit 1 and
    only located problems on stderr; never a traceback."""
    script = Path(sys.executable).with_name("nodeagent")
    assert script.exists(), f"the console script is not installed at {script}"
    before = total("nodeagent validate")

    @fuzz(THROUGH_CLI)
    @given(policies)
    def check(text: str) -> None:
        path = tmp_path / "policy.yaml"
        path.write_bytes(text.encode())
        done = subprocess.run(
            [str(script), "validate", str(path)], capture_output=True, text=True, check=False
        )
        assert "Traceback" not in done.stderr + done.stdout
        if done.returncode == 0:
            assert done.stdout.startswith(f"{path}: ok ("), done.stdout
            count("nodeagent validate", "accepted")
        else:
            assert done.returncode == 1, done.stderr
            check_rejection(done.stderr.removesuffix("\n"), str(path), text)
            count("nodeagent validate", "rejected")

    check()
    assert total("nodeagent validate") - before >= THROUGH_CLI


RESTART_ONLY = (
    "agent.managed_root", "agent.socket", "agent.socket_group", "agent.metrics", "agent.mode",
    "gpu.simulate", "kubernetes.node_name", "kubernetes.pod_resources_socket",
    "kubernetes.pod_resources_timeout", "kubernetes.api_server", "publish.node_resource_topology",
)  # fmt: skip
"""What the daemon uses once, at start (docs/policy.md): a reload changing any is refused."""


SETTINGS = (
    ("agent", "managed_root", "other.slice"),
    ("agent", "socket", "/run/other/nodeagent.sock"),
    ("agent", "socket_group", "wheel"),
    ("agent", "metrics", {"listen": "127.0.0.1:9464"}),
    ("agent", "mode", "kubernetes"),
    ("gpu", "simulate", "/etc/nodeagent/gpus.yaml"),
    ("kubernetes", "node_name", "node-1"),
    ("kubernetes", "pod_resources_socket", "/run/other/kubelet.sock"),
    ("kubernetes", "pod_resources_timeout", "5s"),
    ("kubernetes", "api_server", {"watch": True}),
    ("publish", "node_resource_topology", True),
    ("agent", "interval", "2s"),
    ("agent", "reload_on_change", True),
    ("agent", "runtimes", {"docker": "/run/other/docker.sock", "timeout": "1s"}),
    ("agent", "runtimes", {"crio": None}),
    ("tenants", "extra", {"shares": 3}),
)  # fmt: skip
"""Valid values of restart-only and reloadable settings: a few at once make a file whose
reload must be refused, or applied, more often than random edits do."""


@st.composite
def _set(draw: st.DrawFn) -> str:
    """The example policy with 1 to 4 of SETTINGS set."""
    data = copy.deepcopy(SEED_DATA)
    for section, key, value in draw(st.lists(st.sampled_from(SETTINGS), min_size=1, max_size=4)):
        data.setdefault(section, {})[key] = value
    return yaml.safe_dump(data, sort_keys=False)


def _field(spec: PolicySpec, dotted: str) -> object:
    value: object = spec
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


def expected_reload(
    text: str, filename: str, good: PolicySpec
) -> PolicyError | list[str] | PolicySpec:
    """What a reload of `text` must do, from the loader and the documented rules alone (not
    from the reload's code): the loader's rejection (the file is read as UTF-8 with an
    optional BOM, and one with NUL bytes is refused before it is parsed); or the restart-only
    fields it changes, in RESTART_ONLY's order; or else the policy it applies (with the
    agent's command-line --state-file, which wins over the file's)."""
    if "\0" in text:
        return PolicyError([Problem(filename, 1, 1, "not a text file: it contains NUL bytes")])
    try:
        spec = check_text(text.removeprefix("\ufeff"), filename).spec
    except PolicyError as e:
        return e
    agent = spec.agent.model_copy(update={"state_file": good.agent.state_file})
    spec = spec.model_copy(update={"agent": agent})
    changed = [f for f in RESTART_ONLY if _field(spec, f) != _field(good, f)]
    return changed or spec


@pytest.mark.fuzz
def test_a_reload_does_what_each_file_calls_for(tmp_path: Path) -> None:
    """Each input has one right outcome, found beforehand by expected_reload: rejected with
    the loader's problems, refused naming the restart-only fields it changes, or applied
    (the runtimes' adapters made again exactly when their settings changed); the last good
    policy stays in force unless it is applied."""
    cgroups = tmp_path / "cgroup"
    cgroups.mkdir()
    config = tmp_path / "policy.yaml"
    config.write_text(SEED)
    good = check_text(SEED, str(config)).spec
    agent = open_agent(
        good,
        CgroupTree(str(cgroups)),
        dry_run=True,
        config_path=str(config),
        overrides={"state_file": str(tmp_path / "state.json")},
    )
    good, runtimes = agent.rec.spec, agent.rec.runtimes
    before = total("reload")

    @fuzz(THROUGH_RELOAD)
    @given(policies | _set())
    def check(text: str) -> None:
        agent.rec.spec, agent.rec.runtimes = good, runtimes
        config.write_bytes(text.encode())
        expected = expected_reload(text, str(config), good)
        with structlog.testing.capture_logs() as logs:
            agent.reload()
        events = [e["event"] for e in logs]
        if isinstance(expected, PolicySpec):
            assert events == ["policy.reloaded"]
            assert agent.rec.spec == expected
            reopened = expected.agent.runtimes != good.agent.runtimes
            assert (agent.rec.runtimes is not runtimes) == reopened
            count("reload", "accepted")
            return
        assert agent.rec.spec is good and agent.rec.runtimes is runtimes, (
            f"the policy changed on {events}"
        )
        if isinstance(expected, list):
            assert [(e["event"], e.get("changed")) for e in logs] == [
                ("policy.needs_restart", expected)
            ]
            count("reload", "needs restart")
            return
        assert set(events) == {"policy.invalid"}, events
        assert [e["problem"] for e in logs] == [str(p) for p in expected.problems]
        check_rejection("\n".join(e["problem"] for e in logs), str(config), text)
        count("reload", "rejected")

    check()
    assert total("reload") - before >= THROUGH_RELOAD


def test_the_seed_is_the_shipped_example_and_valid() -> None:
    """The mutations start from a valid policy, so that those which keep it valid exercise
    acceptance too."""
    assert isinstance(check_text(SEED, "seed.yaml").spec, PolicySpec)
