"""80 columns (issue 36, item 7): at COLUMNS=80 every table and every --help fits, and every
table row keeps the part of its name that tells it apart. An operator saw the CGROUP column
cut from the left to 12 characters (two rows both `…ia systemd)`), `gpus` lines of 138
columns, `gpus place` of 234 and help lines of 92, a name in `unit --help` broken mid-word.

The commands run as an operator runs them (the installed script, COLUMNS=80, a pipe): a
fixture cgroup tree for `workloads`, a daemon's recorded answer on a real socket for
`allocations`, the simulated DGX H100 for `gpus` and `gpus place`, the daemon's GPU routes
for what only a daemon shows (assignments, violations, the queue). `allocations` in fewer
columns where that shows more, each path keeping its leaf whole; `explain` and `status`
folded to the width, nothing cut."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from test_cli import POD_UID, allocation, allocations_answer, explanation, nodeagent
from test_gpu_operator import PAIRS, ask, reserve, start

from nodeagent.api.server import ApiServer
from nodeagent.cli import main
from nodeagent.gpualloc.service import GpuService
from nodeagent.tables import Keep, fold, shorten_path, table, wrap

REPO = Path(__file__).resolve().parents[2]
DGX = str(REPO / "config" / "gpus" / "dgx-h100-nvswitch.yaml")
PLACE = ("gpus", "place", "--count", "4", "--busy", "0,5", "--simulate", DGX)
"""docs/gpus.md's invocation against the simulated DGX, with the --help example's request."""

C1 = "3f2a1b0c9d8e" + "0123456789abcdef" * 3 + "4567"
C2 = "3f2a1b0c9d8f" + "fedcba9876543210" * 3 + "7654"  # its first 11 digits are C1's
C3 = "a1b2c3d4e5f6" + "00112233445566778899aabbccddeeff" * 1 + "0" * 20
POD_SYSTEMD = f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice"
HOST = [
    "system.slice/dbus.service",
    "system.slice/nodeagent-workloads.service",
    "system.slice/systemd-journald.service",
    f"system.slice/docker-{C1}.scope",
    f"system.slice/docker-{C2}.scope",
    f"kubepods.slice/kubepods-burstable.slice/{POD_SYSTEMD}/cri-containerd-{C3}.scope",
    "nodeagent.slice/train-llama-70b-finetune",
    "nodeagent.slice/train-llama-70b-pretrain",
]
"""A host as the operator's: services and container scopes written through systemd, two
containers whose ids share 11 digits, a pod's container deep under kubepods.slice, jobs
whose names differ only at their end."""

POLICY = """\
version: 1
tenants:
  research: {shares: 2}
  platform: {shares: 1}
rules:
  - name: jobs
    match: {path: nodeagent.slice/*}
    tenant: research
    class: training
  - name: docker
    match: {runtime: docker}
    tenant: platform
    class: inference
"""


def widest(text: str) -> int:
    return max(map(len, text.splitlines()))


def shown_names(text: str, first: int, column: int = 0) -> list[str]:
    """The cells of `column` in the table whose header is line `first`, to its end or its
    first empty line (cells have no spaces: names here have none)."""
    rows = []
    for line in text.splitlines()[first + 1 :]:
        if not line.strip() or line.startswith("("):  # the end, or the line of what is hidden
            break
        rows.append(line.split()[column])
    return rows


def assert_names_tell_rows_apart(shown: Sequence[str], full: Sequence[str]) -> None:
    """Each shown name is its full name or a cut of it that keeps its end, and they differ
    where the full names do."""
    assert len(shown) == len(full)
    for shown_cell, full_name in zip(shown, full, strict=True):
        cell, name = shown_cell, full_name
        if cell.endswith(" (\u2026)"):  # its note (` (via systemd)`) cut
            cell, name = cell[:-4], name[: name.rindex(" (")]
        if cell != name:
            assert cell.startswith("\u2026"), (cell, name)
            assert name.endswith(cell[1:]), (cell, name)
    assert len(set(shown)) == len(set(full)), shown


def assert_leaves_whole(shown: Sequence[str], full: Sequence[str]) -> None:
    """Each shown name holds its full name's leaf whole (a note after it may be cut)."""
    for cell, name in zip(shown, full, strict=True):
        leaf = name.rsplit("/", 1)[-1].split(" (")[0]
        assert leaf in cell, (cell, name)


def hidden(text: str) -> list[str]:
    """The columns the last line of a table says it hid, in one line ([] where none)."""
    last = text.splitlines()[-1]
    found = re.fullmatch(
        r"\((?:no room in \d+ columns for|not shown:) (.+?)[:;] see --wide\)", last
    )
    return found[1].split(", ") if found else []


# --- the table routine ------------------------------------------------------------------------


def test_a_path_is_cut_by_whole_components_keeping_its_leaf() -> None:
    path = f"kubepods/burstable/pod{POD_UID[:8]}/{C1[:12]}"
    assert shorten_path(path, len(path)) == path
    assert shorten_path(path, 40) == f"\u2026/burstable/pod{POD_UID[:8]}/{C1[:12]}"
    assert shorten_path(path, 30) == f"\u2026/pod{POD_UID[:8]}/{C1[:12]}"
    assert shorten_path(path, 20) == f"\u2026/{C1[:12]}"
    assert shorten_path(path, 10) == "\u2026" + C1[3:12]  # a leaf too wide keeps its end
    assert shorten_path("no-slash-at-all", 8) == "\u2026-at-all"


def test_names_are_cut_last_and_never_to_the_same() -> None:
    """The operator's allocations: the reason went first, then the path to 12 characters,
    `…ia systemd)` twice. Now a name column is cut after every text column, never past its
    leaf, and further only while the names still differ."""
    rows = [
        ("system.slice/dbus.service (via systemd)", "a long reason for this one " * 3),
        ("system.slice/nodeagent-workloads.service (via systemd)", "another reason " * 4),
        ("a.slice/job-1", "-"),
        ("b.slice/job-1", "-"),
    ]
    cut: list[tuple[int, Keep]] = [(1, "head"), (0, "leaf")]
    lines = table(("CGROUP", "REASON"), rows, width=50, cut=cut).splitlines()
    names = [line.split("  ")[0].strip() for line in lines[1:]]
    assert names == [
        "\u2026/dbus.service (via systemd)",
        "\u2026/nodeagent-workloads.service (\u2026)",  # its note shrinks before its leaf
        "a.slice/job-1",  # the leaf alone would not tell it from b's
        "b.slice/job-1",
    ]
    assert lines[1].endswith("a long reas\u2026")  # MIN_CUT: the text went first


def test_ids_keep_the_head_that_tells_them_apart() -> None:
    uuids = [f"GPU-6{n:02d}22876-72fd-4202-aa96-fb1a14a0f9e7" for n in (0, 1, 10)]
    rows = [(u, "x" * 20) for u in uuids]
    cut: list[tuple[int, Keep]] = [(0, "id")]
    cells = [line.split()[0] for line in table(("UUID", "X"), rows, width=30, cut=cut).split("\n")]
    assert cells[1:] == ["GPU-6002287\u2026", "GPU-6012287\u2026", "GPU-6102287\u2026"]
    # never under MIN_CUT, but further where the heads are alike
    rows = [(f"GPU-{'0' * 20}{n}", "x") for n in range(3)]
    cells = [line.split()[0] for line in table(("UUID", "X"), rows, width=10, cut=cut).split("\n")]
    assert cells[1:] == [f"GPU-{'0' * 20}{n}" for n in range(3)]


def test_wrap_breaks_lines_at_spaces_only() -> None:
    line = "why: " + " ".join(["word"] * 30) + " GPU-66d22876-72fd-4202-aa96-fb1a14a0f9e7"
    wrapped = wrap(line, 40).splitlines()
    assert max(map(len, wrapped[:-1])) <= 40 and wrapped[1].startswith("  word")
    assert wrapped[-1] == "  GPU-66d22876-72fd-4202-aa96-fb1a14a0f9e7"  # a word stays whole
    assert wrap(line, None) == line


def test_fold_breaks_a_word_wider_than_a_line_after_a_slash_and_cuts_nothing() -> None:
    path = f"kubepods.slice/{POD_SYSTEMD}/cri-containerd-{C3}.scope"
    line = f"  cpu-weights: level {path}: weight 100, carrying 8.00 cores"
    folded = fold(line, 40).splitlines()
    assert max(map(len, folded)) <= 40
    assert folded[0] == "  cpu-weights: level kubepods.slice/"
    assert all(f.startswith("    ") for f in folded[1:])  # two more than the line's indent
    assert path in "".join(f.strip() for f in folded)  # whole, read across its lines
    assert "".join(folded).replace(" ", "") == line.replace(" ", "")  # nothing cut
    assert fold(line, None) == line
    # a continuation at a column of its own; a word wider than any line broken where it ends
    assert fold("policy        /etc/nodeagent/clusters/pool-a/policy.yaml", 40, 14).split("\n") == [
        "policy        /etc/nodeagent/clusters/",
        "              pool-a/policy.yaml",
    ]
    assert fold("x" * 25, 10).splitlines() == ["x" * 10, "  " + "x" * 8, "  " + "x" * 7]


def test_a_table_says_what_it_hid_in_one_line() -> None:
    """`(no room in 60 columns for ...)` where it fits, else shorter: it was wrapped."""
    headers = ("NAME", "A" * 10, "B" * 10, "C" * 10)
    rows = [("n" * 50, "1", "2", "3")]
    lines = table(headers, rows, width=60, drop=[1, 2, 3]).splitlines()
    assert lines == [
        "NAME",
        "n" * 50,
        f"(not shown: {'A' * 10}, {'B' * 10}, {'C' * 10}; see --wide)",
    ]
    assert hidden("\n".join(lines)) == ["A" * 10, "B" * 10, "C" * 10]
    lines = table(headers, rows, width=75, drop=[1, 2, 3]).splitlines()
    assert lines[-1] == f"(no room in 75 columns for {'A' * 10}: see --wide)"


# --- the commands at COLUMNS=80 ---------------------------------------------------------------


@pytest.fixture
def host(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    for path in HOST:
        (root / path).mkdir(parents=True)
    for d, _, _ in os.walk(root):
        (Path(d) / "cgroup.procs").write_text("")
    return root


def short(path: str) -> str:
    """A path as the tables show it by default: ids short, as `docker ps` shows them."""
    for cid in (C1, C2, C3):
        path = path.replace(cid, cid[:12])
    return path.replace(POD_UID.replace("-", "_"), POD_UID[:8])


def test_workloads_at_80_columns(host: Path, tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(POLICY)
    args = ("workloads", "--cgroup-root", str(host), "--config", str(config))
    proc = nodeagent(*args, COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    assert widest(proc.stdout) <= 80, proc.stdout
    shown = shown_names(proc.stdout, 0)
    listed = sorted([*HOST, HOST[5].rsplit("/", 1)[0]])  # the pod too
    assert len(shown) == len(listed)
    for cell in shown:
        assert any(short(p) == cell or short(p).endswith(cell[1:]) for p in listed), cell
    assert len(set(shown)) == len(shown), proc.stdout
    assert f"system.slice/docker-{C1[:12]}.scope" in shown  # room for it whole
    assert "\u2026/train-llama-70b-finetune" in shown
    # a pipe without COLUMNS: whole lines, as before
    whole = nodeagent(*args)
    assert set(shown_names(whole.stdout, 0)) == {short(p) for p in listed}


@pytest.fixture
def allocations_socket(sockdir: Path) -> Iterator[str]:
    """A daemon's recorded /v1/allocations for HOST on a real socket: reasons of 60
    characters, services and container scopes written through systemd, the containers
    named by their runtime (names and an image that differ late)."""
    rows = []
    for path in HOST:
        row = allocation(path)
        row["reason"] = "cpu weight for a target of 1.33 cores; fair share of research"
        if path.startswith("system.slice/"):
            row["write"] = "systemd"
        if "docker-" in path:
            row["container_name"] = f"web-{HOST.index(path)}"
            row["image"] = "registry.example.com/platform/web:1.25"
        rows.append(row)
    answer = allocations_answer(rows)
    server = ApiServer(str(sockdir / "api.sock"), {"/v1/allocations": {"GET": lambda _: answer}})
    server.start()
    yield server.socket_path
    server.close()


def test_allocations_at_80_columns(allocations_socket: str) -> None:
    proc = nodeagent("allocations", "--socket", allocations_socket, COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    assert widest(proc.stdout) <= 80, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[1].split()[:2] == ["CGROUP", "NAME"]
    # a cell is its path and, written through systemd, " (via systemd)": split at 2 spaces
    shown = [re.split(r"  +", line)[0] for line in lines[2 : 2 + len(HOST)]]
    full = [short(p) + (" (via systemd)" if p.startswith("system.slice/") else "") for p in HOST]
    assert_names_tell_rows_apart(shown, full)
    assert "\u2026/dbus.service (via systemd)" in shown
    names = [re.split(r"  +", line)[1] for line in lines[5:7]]  # the two containers
    assert len(set(names)) == len(names), proc.stdout
    # the compact layout: every leaf whole (it showed `…deagent-workloads.service (…)`),
    # the runtime's names apart from their image, and what it hid named in one last line
    assert_leaves_whole(shown, full)
    assert names == ["web-3", "web-4"]
    assert lines[2 + len(HOST)] == lines[-1]
    assert lines[1].split() == ["CGROUP", "NAME", "WEIGHT", "CAP", "MEM", "CPU"], proc.stdout
    assert hidden(proc.stdout) == ["IMAGE", "PIDS", "HIGH", "CLASS", "TENANT", "REASON"]
    # 200 columns, and --wide at 80, show every column
    for columns, wide in (("200", ()), ("80", ("--wide",))):
        proc = nodeagent("allocations", "--socket", allocations_socket, *wide, COLUMNS=columns)
        gpus = ["GPUS"] if wide else []  # --wide: the column even where no one holds GPUs
        assert proc.stdout.splitlines()[1].split() == [
            *FULL_HEADERS[:-2],
            *gpus,
            *FULL_HEADERS[-2:],
        ], proc.stdout
        assert not hidden(proc.stdout)


FULL_HEADERS = ["CGROUP", "NAME", "TENANT", "CLASS", "CPU.WEIGHT", "CPU.MAX", "MEM.MAX",
                "MEM.HIGH", "PIDS.MAX", "CPU", "REASON"]  # fmt: skip
"""`allocations`' columns where there is room for them all (no GPUS: no workload holds one)."""
GI = 1 << 30
STEADY = {
    "cpu.weight": ("333", "333"),
    "cpu.max": ("max 100000", "max 100000"),
    "memory.max": (str(8 * GI), str(8 * GI)),
    "memory.high": ("max", "max"),
    "pids.max": ("max", "4096"),
}
"""One workload's values as the kernel holds them and as planned: all applied but pids.max."""


def value(current: str, target: str) -> dict[str, str]:
    return {"current": current, "target": target, "policy": "fair_share", "reason": "2 shares"}


@pytest.fixture
def steady_socket(sockdir: Path) -> Iterator[str]:
    """A daemon's /v1/allocations as a node shows it most of the time: the values applied
    (one still to be), cpu.max capped on two rows, the containers named by their runtime,
    a pod's names and a note and a deadline job whose paths are long, a read-only level."""
    rows = []
    for path in HOST:
        row = allocation(path)
        row["values"] = {a: value(c, t) for a, (c, t) in STEADY.items()}
        row["reason"] = "cpu weight for a target of 1.33 cores; fair share of research"
        row["cpu_rate"] = 1.33
        if path.startswith("system.slice/"):
            row["write"] = "systemd"
        if "docker-" in path:
            row["container_name"] = f"web-{HOST.index(path)}"
            row["image"] = "registry.example.com/platform/web:1.25"
            row["values"]["cpu.max"] = value("max 100000", "150000 100000")
        if "cri-containerd" in path:
            row.update(namespace="default", pod="inference-7d9f8", container_name="server")
        rows.append(row)
    level = {**allocation("kubepods.slice"), "level": True, "write": "read-only"}
    level["values"] = {"cpu.weight": value("100", "154")}
    answer = allocations_answer([*rows, level])
    answer["dry_run"] = True
    answer["node_notes"] = [
        {
            "policy": "fair_share",
            "kind": "hierarchy",
            "status": "distorted",
            "message": f"tenant research: 100% planned, 99% expected; read-only levels:"
            f" kubepods.slice, kubepods.slice/kubepods-burstable.slice/{POD_SYSTEMD}",
        }
    ]
    rows[-1]["deadline"] = {
        "status": "on-track",
        "deadline": answer["time"] + 7200,
        "remaining": 3000.0,
        "required_rate": 0.42,
        "rate": 0.5,
        "slack": 1200.0,
        "predicted_finish": answer["time"] + 6000,
    }
    server = ApiServer(str(sockdir / "api.sock"), {"/v1/allocations": {"GET": lambda _: answer}})
    server.start()
    yield server.socket_path
    server.close()


def test_allocations_of_a_steady_node_at_80_columns(steady_socket: str) -> None:
    """At 80 columns what an operator needs: the weight, the CPU cap (in cores) and the CPU
    used beside each path's leaf and each runtime's name; the columns hidden named in one
    line; the head, the note and the deadline jobs fit too."""
    proc = nodeagent("allocations", "--socket", steady_socket, COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    assert widest(proc.stdout) <= 80, proc.stdout
    lines = proc.stdout.splitlines()
    assert lines[:2] == [
        "tick 7 (dry run: nothing written): 8 workloads, 1 parent level; OLD->NEW where",
        "  the kernel differs; CAP: cpu.max in cores",
    ]
    headers = lines[2].split()
    assert headers == ["CGROUP", "NAME", "WEIGHT", "CAP", "CPU"], proc.stdout
    body = [re.split(r"  +", line) for line in lines[3 : 3 + len(HOST) + 1]]
    full = [short(p) + (" (via systemd)" if p.startswith("system.slice/") else "") for p in HOST]
    shown = [cells[0] for cells in body]
    assert_names_tell_rows_apart(shown, [*full, "kubepods.slice (read-only)"])
    assert_leaves_whole(shown, [*full, "kubepods.slice"])
    assert dict(zip(headers, body[3], strict=True)) == {
        "CGROUP": "\u2026/docker-3f2a1b0c9d8e.scope (\u2026)",
        "NAME": "web-3",
        "WEIGHT": "333",
        "CAP": "max->1.50",
        "CPU": "1.33",
    }
    assert body[5][1] == "\u2026/server"  # the pod's container: its leaf
    assert body[-1][:3] == ["kubepods.slice (read-only)", "-", "100 (plan: 154)"]
    at = 3 + len(HOST) + 1
    assert hidden("\n".join(lines[: at + 1])) == [
        "IMAGE", "PIDS", "HIGH", "CLASS", "TENANT", "REASON", "MEM",
    ]  # fmt: skip
    assert lines[at + 1].startswith("hierarchy: distorted: ")
    assert lines[at + 2].startswith("  ")  # the note, folded; its paths with short ids
    assert f"pod{POD_UID[:8]}.slice" in proc.stdout and POD_UID[9:] not in proc.stdout
    deadlines = lines[lines.index("deadline jobs (misses so far: 0)") + 1 :]
    assert deadlines[1].startswith("\u2026/train-llama-70b-pretrain  on-track  in 7200s")
    assert hidden("\n".join(deadlines)) == ["FINISH"]
    for columns, wide in (("200", ()), ("80", ("--wide",))):
        proc = nodeagent("allocations", "--socket", steady_socket, *wide, COLUMNS=columns)
        gpus = ["GPUS"] if wide else []  # --wide: the column even where no one holds GPUs
        assert proc.stdout.splitlines()[1].split() == [
            *FULL_HEADERS[:-2],
            *gpus,
            *FULL_HEADERS[-2:],
        ], proc.stdout
        assert not hidden(proc.stdout)
        assert "150000 100000" in proc.stdout  # cpu.max as the kernel writes it


POD_CONTAINER = HOST[5]
"""The pod's container: its path (123 characters) is wider than a line, its leaf too."""


@pytest.fixture
def explain_socket(sockdir: Path) -> Iterator[str]:
    """A daemon's /v1/explain for the pod's container, with what makes its lines long: the
    runtime's names and image, what the rule matched, reasons and a trace that name its
    pod's path, a write that failed."""
    answer = explanation(POD_CONTAINER)
    answer.update(
        kind="container", runtime="containerd", owner="systemd", write="systemd",
        namespace="default", pod="inference-7d9f8", container_name="server",
        image="registry.example.com/platform/inference-server:2024.11.3",
        matched=["namespace=default", "labels.app.kubernetes.io/name=inference"],
    )  # fmt: skip
    answer["values"]["cpu.weight"] = {
        "current": "100",
        "target": "333",
        "policy": "cpu-weights",
        "reason": "weights follow targets among 4 active siblings: 25.0 per core -> 333",
    }
    level = POD_CONTAINER.rsplit("/", 1)[0]
    answer["trace"] = [
        "matched rule jobs: tenant research, class training",
        f"cpu-weights: weights follow targets among 4 active sibling(s) under {level}:"
        " 25.0 per core -> 333",
        f"cpu-weights: level {level}: weight 333, carrying 13.33 cores for 1 workload(s)",
    ]
    answer["sensed"] = {"cpu_rate": 1.33, "memory_pressure_some_avg10": 0.25}
    answer["writes"] = [
        {
            "attribute": "cpu.weight",
            "old": "100",
            "new": "333",
            "outcome": "failed",
            "detail": f"SetUnitProperties on cri-containerd-{C3}.scope: the unit is not loaded",
        }
    ]
    server = ApiServer(str(sockdir / "api.sock"), {"/v1/explain": {"GET": lambda _: answer}})
    server.start()
    yield server.socket_path
    server.close()


def test_explain_at_80_columns(explain_socket: str) -> None:
    """Lines of 130 characters and more (the path alone is 123): folded, at spaces where a
    line has them, a path after a `/`, each continuation indented under what it continues;
    nothing cut. On a pipe, whole lines as before."""
    args = ("explain", "cri-containerd-a1b2c3d4e5f6", "--socket", explain_socket)
    proc = nodeagent(*args, COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    assert widest(proc.stdout) <= 80, proc.stdout
    lines = proc.stdout.splitlines()
    whole = nodeagent(*args)
    assert widest(whole.stdout) > 120
    assert "".join(proc.stdout.split()) == "".join(whole.stdout.split())  # nothing cut
    # the path, whole across its first lines; what it is below it
    at = next(i for i, line in enumerate(lines) if line.startswith("  ("))
    assert "".join(line.strip() for line in lines[:at]) == POD_CONTAINER
    assert lines[0].endswith("/") and lines[1].startswith("  ")
    assert lines[at] == "  (container, containerd, owner systemd, systemd)"
    assert whole.stdout.startswith(f"{POD_CONTAINER}  (container, containerd, owner systemd,")
    assert "  runtime says: default/inference-7d9f8/server" in proc.stdout  # its names whole
    # a value's reason continues under the value, a trace line under its text
    weight = lines.index(next(line for line in lines if line.startswith("  cpu.weight ")))
    assert lines[weight].startswith("  cpu.weight   100->333  [cpu-weights] weights follow")
    assert lines[weight + 1].startswith(" " * 15) and lines[weight + 1][15] != " "
    write = next(i for i, line in enumerate(lines) if line.startswith("last tick: "))
    trace = lines[lines.index("trace:") + 1 : write]
    assert [line for line in trace if not line.startswith("    ")] == [
        "  matched rule jobs: tenant research, class training",
        "  cpu-weights: weights follow targets among 4 active sibling(s) under",
        "  cpu-weights: level kubepods.slice/kubepods-burstable.slice/",
    ]  # a line ends at a space or after a `/`, never inside a component it could hold
    assert all(line.startswith("  ") for line in lines[write + 1 :])
    assert f"cri-containerd-{C3}.scope:" in "".join(line.strip() for line in lines[write:])


STATUS = {
    "pid": 4242, "dry_run": False, "version": "1.4.0", "started": 1_700_000_000.0,
    "policy_file": "/etc/nodeagent/clusters/gpu-training-pool-a/policies/nodeagent-policy.yaml",
    "policy_sha256": "9f" * 32, "policy_loaded": 1_700_000_100.0, "cgroup_root": "/sys/fs/cgroup",
    "managed_root": "nodeagent.slice/gpu-training-pool-a.slice", "tick": 1234,
    "tick_time": 1_700_000_400.0, "workloads": 17, "slurm_problem": None,
    "deadline_misses": 2, "runtimes": {},
}  # fmt: skip
"""/v1/status from a daemon with a long policy path and managed root."""


@pytest.fixture
def status_socket(sockdir: Path) -> Iterator[str]:
    """A daemon's /v1/status listing problems that name long paths and sockets."""
    path = STATUS["policy_file"]
    answer = {
        **STATUS,
        "problems": [
            "containerd does not answer (/run/containerd/containerd.sock): connection refused",
            f"reload refused, the last good policy stays: {path}:8:18: tenants.prod.shares:"
            " must be at least 1 (got -2)",
            "kubelet does not answer (https://127.0.0.1:10250/pods): certificate signed by"
            " unknown authority",
        ],
    }
    server = ApiServer(str(sockdir / "api.sock"), {"/v1/status": {"GET": lambda _: answer}})
    server.start()
    yield server.socket_path
    server.close()


def test_status_at_80_columns(status_socket: str) -> None:
    """Each label's value and each problem folded under itself; nothing cut; at 200 columns
    and on a pipe one line each."""
    proc = nodeagent("status", "--socket", status_socket, COLUMNS="80")
    assert proc.returncode == 1, proc.stderr  # it lists problems
    assert widest(proc.stdout) <= 80, proc.stdout
    lines = proc.stdout.splitlines()
    labels = [line[:14].rstrip() for line in lines if not line.startswith(" ")]
    assert labels == [
        "nodeagent", "started", "policy", "sha256", "loaded", "last reload", "last tick",
        "workloads", "deadlines", "problems",
    ]  # fmt: skip
    policy = lines.index(next(line for line in lines if line.startswith("policy ")))
    assert lines[policy + 1].startswith(" " * 14)  # the path, folded after a `/`
    assert lines[policy][14:] + lines[policy + 1].strip() == STATUS["policy_file"]
    at = lines.index("problems      3")
    problems = "\n".join(lines[at + 1 :]).replace("\n    ", " ").splitlines()
    assert [p[:4] for p in problems] == ["  - "] * 3
    assert problems[0] == (
        "  - containerd does not answer (/run/containerd/containerd.sock): connection refused"
    )
    wide = nodeagent("status", "--socket", status_socket, COLUMNS="200")
    piped = nodeagent("status", "--socket", status_socket)
    assert wide.stdout == piped.stdout
    assert len(wide.stdout.splitlines()) == 13  # ten labels, three problems
    assert "".join(proc.stdout.split()) == "".join(wide.stdout.split())  # nothing cut


def test_gpus_at_80_columns() -> None:
    proc = nodeagent("gpus", "--simulate", DGX, COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    assert widest(proc.stdout) <= 80, proc.stdout
    first = next(i for i, line in enumerate(proc.stdout.splitlines()) if line.startswith("GPU "))
    uuids = shown_names(proc.stdout, first, column=1)
    assert len(uuids) == 8 and len(set(uuids)) == 8, proc.stdout
    assert all(u.startswith("GPU-") for u in uuids)


@pytest.fixture
def gpu_daemon() -> Iterator[tuple[GpuService, str]]:
    """The pairs node's daemon side: a shared reservation, a request waiting, and processes
    outside any hold (violations), as test_gpu_json has it."""
    for service, sock in start(PAIRS):
        assert reserve(sock, "web", count=1, shared=True, memory=10 << 30, ttl=600)["uuids"]
        assert ask(sock, "big", count=4)["status"] == "waiting"
        yield service, sock


def test_gpus_against_a_daemon_at_80_columns(gpu_daemon: tuple[GpuService, str]) -> None:
    _, sock = gpu_daemon
    proc = nodeagent("gpus", "--socket", sock, COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    assert widest(proc.stdout) <= 80, proc.stdout
    assert "VIOLATIONS" in proc.stdout and "waiting for GPUs" in proc.stdout


def test_gpus_place_at_80_columns() -> None:
    proc = nodeagent(*PLACE, COLUMNS="80")
    assert proc.returncode == 0, proc.stderr
    assert widest(proc.stdout) <= 80, proc.stdout
    whole = nodeagent(*PLACE)
    assert proc.stdout.split() == whole.stdout.split()  # wrapped at spaces, no word cut
    assert widest(whole.stdout) > 80  # a pipe without COLUMNS: whole lines


# --- every --help -------------------------------------------------------------------------------


def command_paths(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[list[str]]:
    yield list(path)
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from command_paths(sub, (*path, name))


HELPS = list(command_paths(main))


@pytest.mark.parametrize("path", HELPS, ids=[" ".join(p) or "nodeagent" for p in HELPS])
def test_every_help_fits_80_columns_without_breaking_a_word(path: list[str]) -> None:
    runner = CliRunner()
    for columns in ("80", "200", None):
        env = {"COLUMNS": columns} if columns else {}
        out = runner.invoke(main, [*path, "--help"], prog_name="nodeagent", env=env).output
        assert widest(out) <= 80, out
    # the same words as the help unwrapped: none broken at the end of a line
    wide = runner.invoke(
        main,
        [*path, "--help"],
        prog_name="nodeagent",
        terminal_width=1000,
        max_content_width=1000,
    ).output
    # (the list of commands cuts each one's summary to the width, with "...": not compared)
    assert out.split("\nCommands:\n")[0].split() == wide.split("\nCommands:\n")[0].split(), out
