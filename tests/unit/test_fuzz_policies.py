"""Fuzzed policies: no input gives a traceback, every rejection is FILE:LINE:COL: message,
and a reload with any of them keeps the last good policy.

10,000 policies per run (policy_fuzz.py: the example policy mutated as text and as data)
through the loader in-process; a sample through the installed `nodeagent validate` (a
process each, so fewer); and a sample through `Agent.reload`. The pytest summary says how
many ran; `pytest --hypothesis-seed N` repeats a run. The fuzzing tests are marked `fuzz`:
`FAST=1 ./scripts/test unit` (pytest -m "not fuzz") leaves them out locally; CI runs them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import structlog
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from policy_fuzz import SEED, check_rejection, count, policies, seeded_policies, total

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent
from nodeagent.policyfile.load import parse_policy
from nodeagent.policyfile.model import PolicySpec
from nodeagent.policyfile.yamlfile import PolicyError

DRAWN = 500
"""Policies whose every choice hypothesis draws: slow to make, but a failure shrinks."""
BATCHES, PER_BATCH = 950, 10
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
    """parse_policy gives a spec, or a PolicyError whose every line is located."""
    try:
        spec = parse_policy(text, "fuzz.yaml")
    except PolicyError as e:
        check_rejection(str(e), "fuzz.yaml", text)
        count("parse_policy", "rejected")
    else:
        assert isinstance(spec, PolicySpec)
        count("parse_policy", "accepted")


@pytest.mark.fuzz
def test_the_loader_accepts_or_locates_every_problem() -> None:
    before = total("parse_policy")
    fuzz(DRAWN)(given(policies)(parsed))()

    @fuzz(BATCHES)
    @given(st.integers(0, 2**64 - 1))
    def batch(seed: int) -> None:
        for n, text in enumerate(seeded_policies(seed, PER_BATCH)):
            try:
                parsed(text)
            except BaseException:
                note(f"policy {n} of seeded_policies({seed}, {PER_BATCH}): {text!r}")
                raise

    batch()
    assert total("parse_policy") - before >= DRAWN + BATCHES * PER_BATCH


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


@pytest.mark.fuzz
def test_a_reload_with_any_of_them_keeps_the_last_good_policy(tmp_path: Path) -> None:
    cgroups = tmp_path / "cgroup"
    cgroups.mkdir()
    config = tmp_path / "policy.yaml"
    config.write_text(SEED)
    good = parse_policy(SEED, str(config))
    agent = open_agent(
        good,
        CgroupTree(str(cgroups)),
        dry_run=True,
        config_path=str(config),
        overrides={"state_file": str(tmp_path / "state.json")},
    )
    good = agent.spec
    before = total("reload")

    @fuzz(THROUGH_RELOAD)
    @given(policies)
    def check(text: str) -> None:
        agent.spec = good
        config.write_bytes(text.encode())
        with structlog.testing.capture_logs() as logs:
            agent.reload()
        events = [e["event"] for e in logs]
        if "policy.reloaded" in events:
            assert agent.spec is not good and events == ["policy.reloaded"]
            count("reload", "accepted")
            return
        assert agent.spec is good, f"the policy changed on {events}"
        if events == ["policy.needs_restart"]:
            count("reload", "needs restart")
            return
        assert events and set(events) == {"policy.invalid"}, events
        check_rejection("\n".join(e["problem"] for e in logs), str(config), text)
        count("reload", "rejected")

    check()
    assert total("reload") - before >= THROUGH_RELOAD


def test_the_seed_is_the_shipped_example_and_valid() -> None:
    """The mutations start from a valid policy, so that those which keep it valid exercise
    acceptance too."""
    assert isinstance(parse_policy(SEED, "seed.yaml"), PolicySpec)
