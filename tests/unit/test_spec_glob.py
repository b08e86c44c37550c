"""Match globs (issue 5, item 9): fnmatch's meaning, compiled in linear time, bounded length.

fnmatch.translate scans for the `]` of every `[` afresh, so 100,000 unclosed `[` took minutes
in `workloads --config`; the loader now refuses a glob over MAX_GLOB characters, and the
compiler (shared by the loader and classification) stays linear on what it accepts.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
from builders import job
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.cli import main
from nodeagent.policyfile.glob import MAX_GLOB, compile_glob, glob_matches
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.matching import matches
from nodeagent.policyfile.model import Match
from nodeagent.policyfile.yamlfile import PolicyError

HEAD = "version: 1\ntenants:\n  research: {shares: 2}\n  prod: {shares: 1}\n"

PATTERN_CHARS = st.sampled_from("ab-]![*?\\^&~|/.")
TEXT_CHARS = st.sampled_from("ab-]![\\^/.c")


@settings(max_examples=1000, deadline=None)
@given(st.text(PATTERN_CHARS, max_size=10), st.text(TEXT_CHARS, max_size=8))
def test_globs_mean_what_fnmatch_means(pattern: str, text: str) -> None:
    assert glob_matches(pattern, text) == fnmatch.fnmatchcase(text, pattern)


@pytest.mark.parametrize(
    ("pattern", "text", "expected"),
    [
        ("nodeagent.slice/research-*", "nodeagent.slice/research-train/x", True),  # '*' crosses /
        ("*.service", "system.slice/cron.service", True),
        ("job-?", "job-12", False),
        ("job-[0-9]", "job-7", True),
        ("job-[!0-9]", "job-7", False),
        ("job-[9-0]", "job-5", False),  # a reversed range is empty
        ("[[]x", "[x", True),
        ("[x", "[x", True),  # an unclosed '[' is a plain '['
        ("[]]", "]", True),
        ("[!]]", "a", True),
        ("a*b*c", "a" * 5000 + "c", False),
        ("", "", True),
        ("*", "", True),
    ],
)
def test_glob_examples(pattern: str, text: str, expected: bool) -> None:
    assert glob_matches(pattern, text) is expected


def test_a_pattern_too_long_is_refused_at_load() -> None:
    text = (
        HEAD + "rules:\n  - name: r\n    match: {path: '" + "[" * 300_000 + "'}\n    tenant: prod\n"
    )
    with pytest.raises(PolicyError) as info:
        check_text(text, "p.yaml")
    assert [str(p) for p in info.value.problems] == [
        "p.yaml:7:19: rules[0].match.path: a glob is at most 1024 characters, got one of"
        " 300000 characters"
    ]


@pytest.mark.parametrize("key", ["path", "name"])
def test_the_longest_glob_is_accepted_and_one_more_is_not(key: str) -> None:
    rule = "rules:\n  - {{name: r, match: {{{key}: '{glob}'}}, tenant: prod}}\n"
    longest = "[" * MAX_GLOB
    spec = check_text(HEAD + rule.format(key=key, glob=longest), "p.yaml").spec
    assert getattr(spec.rules[0].match, key) == longest
    with pytest.raises(PolicyError, match=f"rules\\[0\\].match.{key}: a glob is at most 1024"):
        check_text(HEAD + rule.format(key=key, glob=longest + "["), "p.yaml")


@pytest.mark.parametrize(
    "pattern", ["[" * MAX_GLOB, "[!" * (MAX_GLOB // 2), "*a" * (MAX_GLOB // 2), "*?" * 512]
)
def test_classification_uses_the_compiled_matcher_on_hostile_patterns(pattern: str) -> None:
    """The loader's compiled matcher decides: the same object, and fnmatch's answer."""
    workload = job("nodeagent.slice/" + "a" * 200)
    match = Match.model_validate({"path": pattern})
    assert compile_glob(pattern) is compile_glob(pattern)
    assert matches(match, workload) is fnmatch.fnmatchcase(workload.path, pattern)


def test_workloads_with_a_hostile_pattern_classifies_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    for path in ["nodeagent.slice/research-train", "nodeagent.slice/[[[job"]:
        (root / path).mkdir(parents=True)
        (root / path / "cgroup.procs").write_text("")
    (root / "nodeagent.slice" / "cgroup.procs").write_text("")
    config = tmp_path / "policy.yaml"
    hostile = "[" * (MAX_GLOB - 1) + "*"
    config.write_text(
        HEAD
        + "rules:\n"
        + f"  - {{name: hostile, match: {{name: '{hostile}'}}, tenant: prod}}\n"
        + "  - {name: research, match: {path: 'nodeagent.slice/research-*'}, tenant: research}\n"
    )
    result = CliRunner().invoke(
        main, ["workloads", "--cgroup-root", str(root), "--config", str(config), "--json"]
    )
    assert result.exit_code == 0, result.output
    tenants = {r["cgroup"]: r["tenant"] for r in json.loads(result.stdout)["items"]}
    assert tenants == {"nodeagent.slice/research-train": "research", "nodeagent.slice/[[[job": None}
