"""The policy loader: every problem is reported as FILE:LINE:COL: message, never as a traceback."""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hostile import bad_tenants, outcome_without_blocking_on, unknown_keys
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.errors import NodeagentError
from nodeagent.identity import QosTier, Runtime
from nodeagent.policyfile.load import check_text, load_policy
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.policyfile.yamlfile import MAX_BYTES, MAX_SHOWN, PolicyError, Problem

REPO = Path(__file__).resolve().parents[2]
HEAD = "version: 1\ntenants:\n  research: {shares: 2}\n  prod: {shares: 1}\n"


def problems(text: str) -> list[str]:
    """The loader's report for `text`, one string per problem."""
    with pytest.raises(PolicyError) as info:
        check_text(text, "p.yaml")
    return [str(p) for p in info.value.problems]


def file_problems(path: str | Path) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return [str(p) for p in info.value.problems]


# The shipped example


def test_shipped_example_loads() -> None:
    spec = load_policy(REPO / "config" / "policy.yaml")
    assert {name: t.shares for name, t in spec.tenants.items()} == {"research": 2, "prod": 1}
    assert [r.name for r in spec.rules] == [
        "research-training",
        "prod-jobs",
        "shop-web",
        "k8s-prod-inference",
        "k8s-training",
        "docker-batch",
        "k8s-besteffort",
        "slurm-prod",
        "slurm-jobs",
    ]
    assert spec.rules[0].match.path == (
        "system.slice/nodeagent-workloads.service/workloads/research-*"
    )
    assert spec.rules[0].workload_class is WorkloadClass.TRAINING
    assert spec.rules[2].match.labels == {
        "com.docker.compose.project": "shop",
        "com.docker.compose.service": "web*",
    }
    k8s = spec.rules[3]
    assert (k8s.match.namespace, k8s.match.pod_labels) == (
        "prod-*",
        {"app.kubernetes.io/component": "inference"},
    )
    assert k8s.tenant_from is not None and k8s.tenant_from.allowed == ("prod", "research")
    assert spec.rules[4].deadline_from_annotations
    docker = spec.rules[5]
    assert docker.match.runtime is Runtime.DOCKER
    assert docker.limits.cpu_max == 1.5
    assert docker.limits.memory_max == 4 * 1024**3
    assert docker.limits.memory_high == 3 * 1024**3
    assert spec.rules[6].match.qos is QosTier.BESTEFFORT
    assert (spec.rules[7].match.runtime, spec.rules[7].match.account) == (Runtime.SLURM, "prod")


def test_shipped_example_states_the_defaults() -> None:
    """The example documents each default by spelling it out; they must stay true."""
    example = load_policy(REPO / "config" / "policy.yaml")
    defaults = check_text("version: 1\ntenants: {a: {shares: 1}}\n", "d.yaml").spec
    # but one: the packaged units' managed root, which it names (issue 36 item 2)
    assert example.agent.managed_root == "system.slice/nodeagent-workloads.service/workloads"
    assert defaults.agent.managed_root == "nodeagent.slice"
    assert example.agent.model_copy(update={"managed_root": "nodeagent.slice"}) == defaults.agent
    assert example.fair_share == defaults.fair_share


def test_minimal_policy_and_utf8_bom(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + HEAD.encode())
    spec = load_policy(path)
    assert isinstance(spec, PolicySpec)
    assert spec.rules == ()


# Errors and their messages


def test_problem_and_error_format() -> None:
    a, b = Problem("f.yaml", 3, 7, "one"), Problem("f.yaml", 9, 1, "two")
    assert str(a) == "f.yaml:3:7: one"
    error = PolicyError([a, b])
    assert isinstance(error, NodeagentError)
    assert error.problems == (a, b)
    assert str(error) == "f.yaml:3:7: one\nf.yaml:9:1: two"


def test_wrong_type_points_at_the_value() -> None:
    text = HEAD + "rules:\n  - name: r\n    match: {}\n    tenant: prod\n    limits:\n"
    text += "      memory_max: lots\n"
    assert problems(text) == [
        "p.yaml:10:19: rules[0].limits.memory_max: "
        "expected a size such as 512Mi, 4Gi or a number of bytes, got 'lots'"
    ]


def test_unknown_key_points_at_the_key_and_suggests() -> None:
    text = HEAD + "agent:\n  resync_interval: 5s\n  intervall: 2s\n"
    assert problems(text) == [
        "p.yaml:7:3: unknown key 'intervall' in agent; did you mean 'interval'?"
    ]


def test_unknown_key_without_a_close_match_has_no_suggestion() -> None:
    assert problems(HEAD + "colour: blue\n") == ["p.yaml:5:1: unknown key 'colour'"]


def test_unknown_key_suggests_the_class_alias() -> None:
    text = HEAD + "rules:\n  - name: r\n    match: {}\n    tenant: prod\n    clas: batch\n"
    assert problems(text) == ["p.yaml:9:5: unknown key 'clas' in rules[0]; did you mean 'class'?"]


def test_bad_class_is_located_through_its_alias() -> None:
    text = HEAD + "rules:\n  - name: r\n    match: {}\n    tenant: prod\n    class: trainng\n"
    assert problems(text) == [
        "p.yaml:9:12: rules[0].class: must be 'inference', 'training', 'batch' or "
        "'besteffort', got 'trainng'; did you mean 'training'?"
    ]


def test_missing_key_points_at_the_parent_mapping() -> None:
    text = HEAD + "rules:\n  - name: r\n    tenant: prod\n"
    assert problems(text) == ["p.yaml:6:5: missing required key 'match' in rules[0]"]


def test_missing_top_level_keys() -> None:
    assert problems("# a policy\nrules: []\n") == [
        "p.yaml:2:1: missing required key 'version'",
        "p.yaml:2:1: missing required key 'tenants'",
    ]


def test_every_problem_is_reported_in_file_order() -> None:
    text = (
        "version: 2\n"
        "agent: {interval: 1d, socket_group: 5}\n"
        "tenants:\n"
        "  a: {shares: .inf}\n"
        "  1: {shares: 1}\n"
        "rules:\n"
        "  - {name: r, match: {runtime: dokcer}, tenant: a, limits: {cpu_max: -1}}\n"
    )
    assert problems(text) == [
        "p.yaml:1:10: version: must be 1, got 2",
        "p.yaml:2:19: agent.interval: must be less than or equal to 3600, got 86400.0",
        "p.yaml:2:37: agent.socket_group: must be a string, got 5",
        "p.yaml:4:15: tenants.a.shares: must be a finite number, got inf",
        "p.yaml:5:3: key '1' in tenants must be a string, not int; quote it if it is meant as"
        " a name",
        "p.yaml:7:32: rules[0].match.runtime: must be 'docker', 'containerd', 'crio', "
        "'podman', 'systemd', 'nodeagent', 'kubelet' or 'slurm', got 'dokcer'; did you mean"
        " 'docker'?",
        "p.yaml:7:70: rules[0].limits.cpu_max: "
        "expected a positive number of cores such as 1.5, or 'max', got -1",
    ]


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("{}", "2:10: tenants: must not be empty"),
        ("[a, b]", "2:10: tenants: must be a mapping, got a list"),
        ("{a: 1}", "2:14: tenants.a: must be a mapping, got 1"),
        (
            "{a: {shares: 0}}",
            "2:23: tenants.a.shares: must be greater than or equal to 0.001 and less than or"
            " equal to 1000000, got 0",
        ),
    ],
)
def test_bad_tenants(value: str, where: str) -> None:
    assert problems(f"version: 1\ntenants: {value}\n") == [f"p.yaml:{where}"]


@pytest.mark.parametrize("value", ["true", "0", "-1", ".inf", ".nan", "lots", "[1]"])
def test_bad_cpu_max(value: str) -> None:
    text = HEAD + f"rules:\n  - {{name: r, match: {{}}, tenant: a, limits: {{cpu_max: {value}}}}}\n"
    [problem] = [p for p in problems(text) if "cpu_max" in p]
    assert problem.startswith("p.yaml:6:55: rules[0].limits.cpu_max: expected a positive number")


@pytest.mark.parametrize(("value", "cores"), [("max", "max"), ("1.5", 1.5), ("'2'", 2.0)])
def test_good_cpu_max(value: str, cores: object) -> None:
    text = (
        HEAD + f"rules:\n  - {{name: r, match: {{}}, tenant: prod, limits: {{cpu_max: {value}}}}}\n"
    )
    assert check_text(text, "p.yaml").spec.rules[0].limits.cpu_max == cores


# Checks after the schema


def test_deadline_and_work_go_together() -> None:
    text = HEAD + (
        "rules:\n"
        "  - {name: a, match: {}, tenant: prod, deadline: 2026-12-01T00:00:00Z}\n"
        "  - {name: b, match: {}, tenant: prod, work: 60}\n"
        "  - {name: c, match: {}, tenant: prod, deadline: 2026-12-01T00:00:00Z, work: 60}\n"
    )
    assert problems(text) == [
        "p.yaml:6:50: rules[0].deadline: deadline needs work: the deadline policy plans the"
        " CPU rate from both",
        "p.yaml:7:46: rules[1].work: work needs deadline: the deadline policy plans the CPU"
        " rate from both",
    ]


def test_the_default_job_tenant_must_be_a_tenant() -> None:
    assert problems(HEAD + "jobs: {default_tenant: reserch}\n") == [
        "p.yaml:5:24: jobs.default_tenant: unknown tenant 'reserch'; did you mean 'research'?"
    ]


def test_a_power_window_needs_both_ends() -> None:
    text = HEAD + "gpu:\n  power:\n    - {class: batch, watts: 200, to: '06:00'}\n"
    assert problems(text) == [
        "p.yaml:7:38: gpu.power[0].to: a window needs both from and to (local times such as"
        " '22:00'), got only to"
    ]


def test_unknown_tenant_with_and_without_suggestion() -> None:
    text = HEAD + (
        "rules:\n  - {name: a, match: {}, tenant: reserch}\n  - {name: b, match: {}, tenant: zzz}\n"
    )
    assert problems(text) == [
        "p.yaml:6:34: rules[0].tenant: unknown tenant 'reserch'; did you mean 'research'?",
        "p.yaml:7:34: rules[1].tenant: unknown tenant 'zzz'; tenants are 'research', 'prod'",
    ]


def test_duplicate_rule_names() -> None:
    text = HEAD + (
        "rules:\n"
        "  - {name: a, match: {}, tenant: prod}\n"
        "  - {name: b, match: {}, tenant: prod}\n"
        "  - {name: a, match: {}, tenant: prod}\n"
    )
    assert problems(text) == [
        "p.yaml:8:12: rules[2].name: duplicate rule name 'a' (first at line 6)"
    ]


@pytest.mark.parametrize("root", ["/abs.slice", "a/../b", "..", "a//b", "a/", "./a", "/"])
def test_managed_root_must_be_a_clean_relative_path(root: str) -> None:
    assert problems(HEAD + f"agent:\n  managed_root: '{root}'\n") == [
        "p.yaml:6:17: agent.managed_root: must be a path relative to the cgroup root, such as "
        f"nodeagent.slice, without '..' or empty parts, got {root!r}"
    ]


def test_nested_managed_root_is_fine() -> None:
    spec = check_text(HEAD + "agent: {managed_root: nodeagent.slice/gpu.slice}\n", "p.yaml").spec
    assert spec.agent.managed_root == "nodeagent.slice/gpu.slice"


def test_memory_high_above_memory_max() -> None:
    text = HEAD + (
        "rules:\n"
        "  - name: r\n"
        "    match: {}\n"
        "    tenant: prod\n"
        "    limits: {memory_max: 1Gi, memory_high: 2Gi}\n"
    )
    assert problems(text) == [
        "p.yaml:9:44: rules[0].limits.memory_high: "
        "memory_high (2147483648 bytes) is above memory_max (1073741824 bytes)"
    ]


@pytest.mark.parametrize(
    ("high", "cap", "expected"),
    [("1Gi", "1Gi", 1 << 30), ("2Gi", "max", 2 << 30), ("2Gi", "null", 2 << 30)],
)
def test_memory_high_not_above_memory_max(high: str, cap: str, expected: int) -> None:
    text = HEAD + "rules:\n  - name: r\n    match: {}\n    tenant: prod\n"
    text += f"    limits: {{memory_max: {cap}, memory_high: {high}}}\n"
    assert check_text(text, "p.yaml").spec.rules[0].limits.memory_high == expected


def test_memory_high_max_with_a_finite_memory_max_is_refused() -> None:
    text = HEAD + "rules:\n  - name: r\n    match: {}\n    tenant: prod\n"
    text += "    limits: {memory_max: 1Gi, memory_high: max}\n"
    assert problems(text) == [
        "p.yaml:9:44: rules[0].limits.memory_high: "
        "memory_high (max) is above memory_max (1073741824 bytes)"
    ]


def test_a_memory_size_without_a_unit_below_1mi_is_refused() -> None:
    text = HEAD + "rules:\n  - {name: r, match: {}, tenant: prod, limits: {memory_max: 512}}\n"
    assert problems(text) == [
        "p.yaml:6:61: rules[0].limits.memory_max: 512 bytes is below 1Mi; sizes are bytes"
        " unless they have a unit, such as 512Mi"
    ]


@pytest.mark.parametrize("root", ["system.slice", "system.slice/foo", "kubepods/x", "docker"])
def test_a_managed_root_inside_another_owners_tree_is_refused(root: str) -> None:
    text = HEAD.replace("version: 1\n", f"version: 1\nagent: {{managed_root: {root}}}\n", 1)
    found = problems(text)
    assert len(found) == 1
    assert "agent.managed_root: " in found[0]
    assert "systemd or a container runtime owns" in found[0]


def test_a_managed_root_below_our_own_service_is_allowed() -> None:
    root = "system.slice/nodeagent.service/workloads"
    text = HEAD.replace("version: 1\n", f"version: 1\nagent: {{managed_root: {root}}}\n", 1)
    assert check_text(text, "p.yaml").spec.agent.managed_root == root


def test_cpu_quota_below_kernel_minimum() -> None:
    text = HEAD + "rules:\n  - {name: r, match: {}, tenant: prod, limits: {cpu_max: 0.005}}\n"
    assert problems(text) == [
        "p.yaml:6:58: rules[0].limits.cpu_max: 0.005 cores is less than the kernel's minimum "
        "quota of 1000us per 100000us period"
    ]
    ok = text.replace("0.005}", "0.005, cpu_period_us: 1000000}")
    assert check_text(ok, "p.yaml").spec.rules[0].limits.cpu_max == 0.005


# YAML-level problems


def test_duplicate_keys() -> None:
    text = HEAD + "agent:\n  interval: 1s\n  interval: 2s\ntenants: {x: {shares: 1}}\n"
    assert problems(text) == [
        "p.yaml:7:3: duplicate key 'interval' (first at line 6)",
        "p.yaml:8:1: duplicate key 'tenants' (first at line 2)",
    ]


def test_merge_keys_are_not_duplicates() -> None:
    text = HEAD + (
        "rules:\n"
        "  - name: a\n"
        "    match: {}\n"
        "    tenant: prod\n"
        "    limits: &small {cpu_max: 1, memory_max: 1Gi}\n"
        "  - name: b\n"
        "    match: {}\n"
        "    tenant: prod\n"
        "    limits: {<<: *small, cpu_max: 2}\n"
    )
    spec = check_text(text, "p.yaml").spec
    assert spec.rules[1].limits.cpu_max == 2
    assert spec.rules[1].limits.memory_max == 1024**3


def test_yaml_syntax_error() -> None:
    assert problems(HEAD + "agent:\n  interval: 1s\n   socket: x\n") == [
        "p.yaml:7:10: mapping values are not allowed here"
    ]


def test_unclosed_flow_mapping() -> None:
    [problem] = problems("version: 1\ntenants: {a: {shares: 1}\n")
    assert problem.startswith(
        "p.yaml:3:1: while parsing a flow mapping (line 2): expected ',' or '}'"
    )


def test_two_documents() -> None:
    assert problems(HEAD + "---\nversion: 1\n") == [
        "p.yaml:5:1: expected a single document in the stream (line 1): but found another document"
    ]


def test_control_character() -> None:
    assert problems('version: 1\nname: "a\x01b"\n') == [
        "p.yaml:2:9: unacceptable character #x0001: special characters are not allowed"
    ]


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n  # another\n", "---\n", "~\n"])
def test_empty_policy(text: str) -> None:
    assert problems(text) == [
        "p.yaml:1:1: the policy is empty; see config/policy.yaml for an example"
    ]


@pytest.mark.parametrize(
    ("text", "got"), [("- a\n- b\n", "a list"), ("hello\n", "'hello'"), ("\n\n42\n", "42")]
)
def test_top_level_must_be_a_mapping(text: str, got: str) -> None:
    line = text.count("\n", 0, len(text) - len(text.lstrip("\n"))) + 1
    assert problems(text) == [
        f"p.yaml:{line}:1: the policy must be a mapping with keys such as version, tenants "
        f"and rules, got {got}"
    ]


def test_python_tags_are_refused() -> None:
    text = HEAD + "agent: !!python/object/apply:os.system ['true']\n"
    assert problems(text) == [
        "p.yaml:5:8: could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object/apply:os.system'"
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("!!int abc", "invalid int value: invalid literal for int() with base 10: 'abc'"),
        ("!!bool maybe", "invalid bool value: 'maybe'"),
        ("2021-13-01", "invalid timestamp value: month must be in 1..12"),
    ],
)
def test_bad_tagged_scalars(value: str, message: str) -> None:
    assert problems(f"version: 1\nstamp: {value}\n") == [f"p.yaml:2:8: {message}"]


def test_alias_bomb_is_refused() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    assert problems("\n".join(lines) + "\n") == [
        "p.yaml:1:1: the policy has more than 100000 YAML nodes, counting each use of an alias; "
        "a policy is far smaller"
    ]


def test_recursive_alias_is_refused() -> None:
    assert problems("version: 1\nloop: &l [1, *l]\n") == [
        "p.yaml:2:7: an alias refers to a node that contains it"
    ]


def test_deep_nesting() -> None:
    assert problems("[" * 5000) == ["p.yaml:1:1: the policy is nested too deeply"]


# Files


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert file_problems(path) == [f"{path}:1:1: cannot read: No such file or directory"]


def test_directory(tmp_path: Path) -> None:
    assert file_problems(tmp_path) == [
        f"{tmp_path}:1:1: cannot read: it is a directory, not a regular file"
    ]


def test_unreadable_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text(HEAD)
    path = (
        tmp_path / "file" / "p.yaml"
    )  # a regular file used as a directory: ENOTDIR, even for root
    assert file_problems(path) == [f"{path}:1:1: cannot read: Not a directory"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"version: 1\x00\n", "not a text file: it contains NUL bytes"),
        (b"version: 1\n\xff\xfe", "not a text file: invalid UTF-8 at byte 11"),
    ],
)
def test_binary_file(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(data)
    assert file_problems(path) == [f"{path}:1:1: {message}"]


def test_huge_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"#" * (MAX_BYTES + 1))
    assert file_problems(path) == [f"{path}:1:1: larger than 1 MiB; a policy is a few kilobytes"]


def test_file_problems_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(HEAD + "colour: blue\n")
    assert file_problems(str(path)) == [f"{path}:5:1: unknown key 'colour'"]


# Nothing but PolicyError, whatever the input


def check_outcome(load: object, filename: str) -> None:
    """`load` either gives a spec or raises PolicyError with well-formed problems."""
    assert callable(load)
    try:
        spec = load()
    except PolicyError as e:
        assert e.problems
        for p in (*e.problems, *e.warnings):
            assert p.file == filename
            assert p.line >= 1
            assert p.col >= 1
            assert p.message
            assert "<broken>" not in p.message  # a partial spec's stand-in never shows
    else:
        assert isinstance(spec, PolicySpec)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_gives_a_spec_or_policy_error(text: str) -> None:
    check_outcome(lambda: check_text(text, "t.yaml").spec, "t.yaml")


@settings(max_examples=100, deadline=None)
@given(st.binary())
def test_any_bytes_give_a_spec_or_policy_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.yaml")
        with open(path, "wb") as f:
            f.write(data)
        check_outcome(lambda: load_policy(path), path)


KEYS = st.sampled_from(
    [
        "version", "agent", "fair_share", "tenants", "rules", "name", "match", "tenant",
        "class", "workload_class", "limits", "shares", "interval", "managed_root", "half_life",
        "cpu_max", "memory_max", "memory_high", "cpu_period_us", "runtime", "qos", "path",
    ]
)  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.sampled_from(["max", "4Gi", "1.5", "30s", "docker", "a", "..", "/x", "nodeagent.slice"])
    | st.text(max_size=8)
)
DATA = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(KEYS | st.text(max_size=6) | st.integers(), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(KEYS, DATA, max_size=6))
def test_any_yaml_mapping_gives_a_spec_or_policy_error(data: dict[str, object]) -> None:
    text = yaml.safe_dump(data)
    check_outcome(lambda: check_text(text, "t.yaml").spec, "t.yaml")


YAML_PIECES = st.sampled_from(
    [
        "{", "}", "[", "]", ":", "- ", ",", "'", '"', "#", "?", " ", "\n", "\t", "a", "1", ".",
        "~", "!!int ", "!!bool ", "!!float ", "!!timestamp ", "!!binary ", "!!set ", "!!omap ",
        "<<: ", "&a ", "*a", "version: 1\n", "tenants:", "rules:\n- ", "2020-01-01", "0x", "1e9",
    ]
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(st.lists(YAML_PIECES, max_size=40).map("".join))
def test_yaml_like_text_gives_a_spec_or_policy_error(text: str) -> None:
    check_outcome(lambda: check_text(text, "t.yaml").spec, "t.yaml")


# Files that are not regular files (issue 5, item 5)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "policy.yaml"
    os.mkfifo(fifo)
    error = outcome_without_blocking_on(str(fifo), lambda: load_policy(fifo))
    assert isinstance(error, PolicyError)
    assert [str(p) for p in error.problems] == [
        f"{fifo}:1:1: cannot read: it is a FIFO, not a regular file"
    ]


def test_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert file_problems(path) == [
            f"{path}:1:1: cannot read: it is a socket, not a regular file"
        ]


def test_a_device_is_refused() -> None:
    assert file_problems(Path("/dev/null")) == [
        "/dev/null:1:1: cannot read: it is a character device, not a regular file"
    ]


def test_a_symlink_to_a_regular_file_is_followed(tmp_path: Path) -> None:
    """Kubernetes mounts ConfigMaps as symlinks; only what they point to must be regular."""
    target = tmp_path / "real.yaml"
    target.write_text(HEAD)
    link = tmp_path / "policy.yaml"
    link.symlink_to(target)
    assert set(load_policy(link).tenants) == {"research", "prod"}
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link.unlink()
    link.symlink_to(fifo)
    error = outcome_without_blocking_on(str(fifo), lambda: load_policy(link))
    assert isinstance(error, PolicyError)
    assert "it is a FIFO, not a regular file" in str(error)


# Very many problems (item 6): all are found, in linear time; the first MAX_SHOWN are shown


@pytest.mark.parametrize(
    ("make", "first", "last_shown"),
    [
        (
            bad_tenants,
            "p.yaml:3:16: tenants.t0.shares: must be greater than or equal to 0.001 and less"
            " than or equal to 1000000, got -1",
            "p.yaml:102:17: tenants.t99.shares: must be greater than or equal to 0.001 and"
            " less than or equal to 1000000, got -1",
        ),
        (
            unknown_keys,
            "p.yaml:5:5: unknown key 'k0' in tenants.a",
            "p.yaml:104:5: unknown key 'k99' in tenants.a",
        ),
    ],
)
def test_many_problems_are_counted_and_the_first_are_shown(
    make: Callable[[int], str], first: str, last_shown: str
) -> None:
    with pytest.raises(PolicyError) as info:
        check_text(make(2000), "p.yaml")
    error = info.value
    assert len(error.problems) == MAX_SHOWN == 100
    assert error.omitted == 1900
    assert str(error.problems[0]) == first
    assert str(error.problems[-1]) == last_shown
    assert str(error).splitlines()[-1] == "p.yaml: ... and 1900 more problems"


def test_few_problems_are_all_shown() -> None:
    with pytest.raises(PolicyError) as info:
        check_text(bad_tenants(MAX_SHOWN), "p.yaml")
    assert len(info.value.problems) == MAX_SHOWN
    assert info.value.omitted == 0
    assert "more problems" not in str(info.value)


def test_unknown_tenants_among_very_many_are_each_reported_with_a_short_list() -> None:
    """Over MAX_CANDIDATES tenants, no 'did you mean' (each costs a pass over them all)."""
    tenants = "".join(f"  team{i}: {{shares: 1}}\n" for i in range(1200))
    rules = "".join(f"  - {{name: r{i}, match: {{}}, tenant: teem{i}}}\n" for i in range(300))
    with pytest.raises(PolicyError) as info:
        check_text(f"version: 1\ntenants:\n{tenants}rules:\n{rules}", "p.yaml")
    assert info.value.omitted == 200
    assert str(info.value.problems[0]) == (
        "p.yaml:1204:35: rules[0].tenant: unknown tenant 'teem0'; tenants are 'team0',"
        " 'team1', 'team2', 'team3', 'team4', 'team5', 'team6', 'team7', 'team8', 'team9'"
        " and 1190 more"
    )


def test_an_unknown_tenant_among_few_gets_a_suggestion() -> None:
    text = (
        HEAD
        + "rules:\n"
        + "".join(f"  - {{name: r{i}, match: {{}}, tenant: prd}}\n" for i in range(300))
    )
    with pytest.raises(PolicyError) as info:
        check_text(text, "p.yaml")
    assert all(p.message.endswith("did you mean 'prod'?") for p in info.value.problems)


# Keys that are not strings, and CR line endings (item 8)


@pytest.mark.parametrize(
    ("key", "kind"),
    [(".nan", "float"), ("~", "null"), ("2001-01-01", "timestamp"), ("1", "int"), ("no", "bool")],
)
def test_a_key_that_is_not_a_string_is_reported_at_the_key(key: str, kind: str) -> None:
    text = (
        f'version: 1\ntenants:\n  "1": {{shares: 1}}\n  a: {{shares: 1}}\n  {key}: {{shares: 1}}\n'
    )
    assert problems(text) == [
        f"p.yaml:5:3: key {key!r} in tenants must be a string, not {kind}; quote it if it is"
        " meant as a name"
    ]


@pytest.mark.parametrize("key", [".nan", "~", "2001-01-01", "1"])
def test_a_top_level_key_that_is_not_a_string_is_reported_at_the_key(key: str) -> None:
    found = problems(f"version: 1\ntenants: {{a: {{shares: 1}}}}\n{key}: x\n")
    assert len(found) == 1
    assert found[0].startswith(f"p.yaml:3:1: key {key!r} must be a string")


def test_what_is_under_a_bad_key_is_still_checked() -> None:
    assert problems("version: 1\ntenants:\n  a: {shares: 1}\n  ~: {shares: -1}\n") == [
        "p.yaml:4:3: key '~' in tenants must be a string, not null; quote it if it is meant"
        " as a name",
        "p.yaml:4:15: tenants['~'].shares: must be greater than or equal to 0.001 and less than"
        " or equal to 1000000, got -1",
    ]


def test_a_list_as_a_key() -> None:
    assert problems("version: 1\ntenants:\n  a: {shares: 1}\n  ? [a, b]\n  : {shares: 1}\n") == [
        "p.yaml:4:5: a key in tenants must be a string, got a list"
    ]


@pytest.mark.parametrize("newline", ["\r", "\r\n", "\n", "\x85", "\u2028"])
def test_reader_errors_are_located_whatever_the_line_breaks(newline: str) -> None:
    text = newline.join(["version: 1", "tenants:", "  a: {shares: 1}", '  b: "x\x01"', ""])
    assert problems(text) == [
        "p.yaml:4:8: unacceptable character #x0001: special characters are not allowed"
    ]


@pytest.mark.parametrize("newline", ["\r", "\r\n", "\n"])
def test_scanner_and_schema_errors_are_located_with_cr_line_breaks(newline: str) -> None:
    text = newline.join(["version: 1", "tenants:", "  a: {shares: 1}", "  b: @x", ""])
    assert problems(text) == [
        "p.yaml:4:6: while scanning for the next token: found character '@' that cannot"
        " start any token"
    ]
    text = newline.join(["version: 1", "tenants:", "  a: {shares: 1}", "  b: {shares: x}", ""])
    assert problems(text) == ["p.yaml:4:15: tenants.b.shares: must be a number, got 'x'"]


# Host paths (item 7): what validate refuses for agent.state_file and agent.socket


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/dev/zero", "must not be under /dev, where files are devices or kernel interfaces"),
        ("/proc/self/environ", "must not be under /proc"),
        ("/sys/fs/cgroup/state.json", "must not be under /sys"),
        ("state.json", "must be an absolute path without '.', '..' or empty parts"),
        ("/var/lib/../../dev/zero", "must be an absolute path without '.', '..' or empty parts"),
        ("/var/lib//state.json", "must be an absolute path"),
        ("/var/lib/nodeagent/", "must be an absolute path"),
        ("/", "must be an absolute path"),
        ("''", "must be an absolute path"),
        ('"/var/lib/a\\0b"', "must not contain a NUL byte"),
    ],
)
@pytest.mark.parametrize("key", ["state_file", "socket"])
def test_unsafe_host_paths_are_refused(key: str, path: str, message: str) -> None:
    found = problems(HEAD + f"agent:\n  {key}: {path}\n")
    assert len(found) == 1
    assert found[0].startswith(f"p.yaml:6:{len(key) + 5}: agent.{key}: {message}")


def test_a_socket_path_too_long_for_the_kernel_is_refused() -> None:
    path = "/run/" + "s" * 103
    assert problems(HEAD + f"agent:\n  socket: {path}\n") == [
        "p.yaml:6:11: agent.socket: a socket path is at most 107 bytes (the kernel's limit),"
        " got 108 bytes"
    ]
    assert check_text(HEAD + f"agent:\n  socket: {path[:-1]}\n", "p.yaml").spec.agent.socket


def test_the_state_file_and_the_socket_must_differ() -> None:
    assert problems(HEAD + "agent: {state_file: /run/x, socket: /run/x}\n") == [
        "p.yaml:5:37: agent.socket: must not be the same path as agent.state_file"
    ]


def test_shipped_example_names_a_default_tenant_for_exec() -> None:
    spec = load_policy(REPO / "config" / "policy.yaml")
    assert spec.jobs.default_tenant in spec.tenants
    assert spec.classes[WorkloadClass.INFERENCE].protect
    assert spec.classes[WorkloadClass.INFERENCE].reserved_cpu == (0.2, True)


# Every problem in one round (issue 13, item 18)

TWO_ROUNDS = """\
version: 1
agent:
  interval: soon
tenants:
  research: {shares: 2}
  prod: {shares: many}
rules:
  - name: jobs
    match: {kind: job}
    tenant: reserch
    limits: {cpu_max: 0.001}
  - name: jobs
    match: {runtime: dockr}
    tenant: prod
    limits: {memory_max: 1Gi, memory_high: 2Gi}
"""


def test_type_errors_do_not_hide_the_checks_across_fields() -> None:
    """The unknown tenant, the duplicate rule, the tiny quota and memory_high above
    memory_max were reported only once the type errors were fixed: a second round."""
    assert problems(TWO_ROUNDS) == [
        "p.yaml:3:13: agent.interval: expected a duration such as 500ms, 30s, 5m or 1h, got 'soon'",
        "p.yaml:6:18: tenants.prod.shares: must be a number, got 'many'",
        "p.yaml:10:13: rules[0].tenant: unknown tenant 'reserch'; did you mean 'research'?",
        "p.yaml:11:23: rules[0].limits.cpu_max: 0.001 cores is less than the kernel's minimum"
        " quota of 1000us per 100000us period",
        "p.yaml:12:11: rules[1].name: duplicate rule name 'jobs' (first at line 8)",
        "p.yaml:13:22: rules[1].match.runtime: must be 'docker', 'containerd', 'crio', 'podman',"
        " 'systemd', 'nodeagent', 'kubelet' or 'slurm', got 'dockr'; did you mean 'docker'?",
        "p.yaml:15:44: rules[1].limits.memory_high: memory_high (2147483648 bytes) is above"
        " memory_max (1073741824 bytes)",
    ]


@pytest.mark.parametrize(
    ("change", "gone", "kept"),
    [
        # the tenants are broken: no tenant can be called unknown; the rules are still checked
        (("  research: {shares: 2}\n  prod: {shares: many}\n", "  - 5\n"), "unknown tenant",
         "duplicate rule name"),
        # one rule's limits are broken: its own limit checks go, the other rule's stay
        (("limits: {cpu_max: 0.001}", "limits: [1]"), "minimum quota", "memory_high (2147483648"),
        # a tenant that is not a string is a type error, not an unknown tenant
        (("tenant: reserch", "tenant: [reserch]"), "unknown tenant", "minimum quota"),
        # a broken name is a type error, and no duplicate of anything
        (("  - name: jobs\n    match: {runtime", "  - name: {a: 1}\n    match: {runtime"),
         "duplicate rule name", "memory_high (2147483648"),
        # the whole rules list broken: the other checks still run
        (("rules:\n", "rules: 5\nx:\n"), "duplicate rule name", "agent.interval"),
    ],
)  # fmt: skip
def test_a_broken_field_skips_only_the_checks_that_read_it(
    change: tuple[str, str], gone: str, kept: str
) -> None:
    old, new = change
    assert old in TWO_ROUNDS
    found = "\n".join(problems(TWO_ROUNDS.replace(old, new, 1)))
    assert gone not in found
    assert kept in found
    assert "<broken>" not in found


def warnings_of(text: str) -> list[str]:
    """The warnings of `text`, but for nesting claims (tests/unit/test_spec_nesting.py)."""
    found = check_text(text, "p.yaml").warnings
    return [str(w) for w in found if not re.match(r"rules\[\d+\]\.match: ", w.message)]


def test_a_policy_without_rules_is_valid_with_a_warning() -> None:
    warning = (
        "warning: the policy has no rules: it claims no workload, and manages only the jobs"
        " that `nodeagent exec` starts"
    )
    assert warnings_of(HEAD) == [f"p.yaml:1:1: {warning}"]
    assert warnings_of(HEAD + "rules: []\n") == [f"p.yaml:5:8: {warning}"]
    assert warnings_of(HEAD + "rules: [{name: a, match: {}, tenant: prod}]\n") == []


@pytest.mark.parametrize(
    ("earlier", "later", "shadowed"),
    [
        ("{}", "{kind: job}", True),
        ("{kind: job}", "{kind: job, path: 'nodeagent.slice/x'}", True),
        ("{path: 'nodeagent.slice/*'}", "{path: nodeagent.slice/train}", True),
        ("{name: 'train-?'}", "{name: train-1, runtime: nodeagent}", True),
        ("{container_id: 4f1c}", "{container_id: 4f1c2a9b}", True),
        ("{qos: besteffort}", "{qos: besteffort}", True),
        # not decided without matching one glob against another: no warning
        ("{path: 'nodeagent.slice/*'}", "{path: 'nodeagent.slice/t*'}", False),
        ("{container_id: 4f1c2a9b}", "{container_id: 4f1c}", False),
        ("{kind: job}", "{kind: container}", False),
        ("{kind: job, runtime: docker}", "{kind: job}", False),
        ("{path: 'nodeagent.slice/*'}", "{name: train}", False),
    ],
)
def test_a_rule_an_earlier_one_shadows_is_warned_about(
    earlier: str, later: str, shadowed: bool
) -> None:
    text = HEAD + (
        f"rules:\n  - {{name: first, match: {earlier}, tenant: prod}}\n"
        f"  - {{name: second, match: {later}, tenant: research}}\n"
    )
    matches = "every cgroup" if earlier == "{}" else "every cgroup it matches"
    assert warnings_of(text) == (
        [
            f"p.yaml:7:27: warning: rules[1]: rule 'second' never applies: rule 'first'"
            f" (line 6) comes first and matches {matches} (the first match wins)"
        ]
        if shadowed
        else []
    )


def test_a_bad_declared_deadlines_is_named_with_its_line() -> None:
    """Issue 34 item 9: classes.<c>.declared_deadlines, checked as every key is."""
    with pytest.raises(PolicyError) as info:
        check_text(HEAD + "classes:\n  training: {declared_deadlines: yes}\n", "p.yaml")
    assert [str(p) for p in info.value.problems] == [
        "p.yaml:6:34: classes.training.declared_deadlines: must be 'defended', 'scheduled' or"
        " 'refused', got true"
    ]
    spec = check_text(HEAD + "classes:\n  training: {declared_deadlines: defended}\n", "p").spec
    assert str(spec.classes[WorkloadClass.TRAINING].declared_deadlines) == "defended"
    assert str(spec.classes[WorkloadClass.BATCH].declared_deadlines) == "refused", "default"


@pytest.mark.parametrize(
    ("rule", "classes", "warned"),
    [
        ("class: training", "", "training"),
        ("class: training", "classes: {training: {declared_deadlines: scheduled}}\n", None),
        ("class_from: {label: c, allowed: [training]}", "", "training, batch"),
        (
            "class_from: {label: c, allowed: [training]}",
            "classes: {training: {declared_deadlines: defended}}\n",
            None,
        ),
    ],
)
def test_annotations_no_class_takes_a_deadline_from_are_warned_about(
    rule: str, classes: str, warned: str | None
) -> None:
    """A rule that reads deadlines from annotations where every class it may give refuses
    them: valid, but its annotations never give a deadline."""
    text = (
        HEAD
        + classes
        + (
            f"rules:\n  - {{name: r, match: {{}}, tenant: prod, {rule},"
            " deadline_from_annotations: true}\n"
        )
    )
    found = warnings_of(text)
    if warned is None:
        assert found == []
        return
    (line,) = found
    assert line.startswith("p.yaml:6:") and f"every class the rule may give ({warned})" in line
    assert "classes.<class>.declared_deadlines, refused by default" in line


def test_a_rejected_policy_carries_its_warnings_too() -> None:
    text = HEAD.replace("shares: 1", "shares: x") + (
        "rules:\n  - {name: all, match: {}, tenant: prod}\n"
        "  - {name: jobs, match: {kind: job}, tenant: prod}\n"
    )
    with pytest.raises(PolicyError) as info:
        check_text(text, "p.yaml")
    assert [str(p) for p in info.value.problems] == [
        "p.yaml:4:18: tenants.prod.shares: must be a number, got 'x'"
    ]
    assert [w.line for w in info.value.warnings] == [7]
    assert "rule 'jobs' never applies" in info.value.warnings[0].message


@pytest.mark.parametrize(
    ("account", "warned"),
    [("Physics", True), ("'HPC-*'", True), ("physics", False), ("'hpc-*'", False)],
)
def test_an_account_in_capitals_is_warned_about(account: str, warned: bool) -> None:
    """Slurm records a job's account in lower case (Debian 12's slurmctld, in
    tests/kernel/test_slurm.py: `sbatch --account=A` runs under 'a'): a glob with capitals
    never matches it."""
    text = HEAD + (
        f"rules:\n  - {{name: hpc, match: {{runtime: slurm, account: {account}}}, tenant: prod}}\n"
    )
    bare = account.strip("'")
    assert warnings_of(text) == (
        [
            f"p.yaml:6:50: warning: rules[0].match.account: {bare!r} never matches: Slurm"
            f" records accounts in lower case (sbatch --account=A runs under 'a');"
            f" write {bare.lower()!r}"
        ]
        if warned
        else []
    )
