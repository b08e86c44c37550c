"""80 columns (issue 36, item 7): at COLUMNS=80 every table and every --help fits, and every
table row keeps the part of its name that tells it apart. An operator saw the CGROUP column
cut from the left to 12 characters (two rows both `…ia systemd)`), `gpus` lines of 138
columns, `gpus place` of 234 and help lines of 92, a name in `unit --help` broken mid-word.

The commands run as an operator runs them (the installed script, COLUMNS=80, a pipe): a
fixture cgroup tree for `workloads`, a daemon's recorded answer on a real socket for
`allocations`, the simulated DGX H100 for `gpus` and `gpus place`, the daemon's GPU routes
for what only a daemon shows (assignments, violations, the queue)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from test_cli import POD_UID, allocation, allocations_answer, nodeagent
from test_gpu_operator import PAIRS, ask, reserve, start

from nodeagent.api.server import ApiServer
from nodeagent.cli import main
from nodeagent.gpualloc.service import GpuService
from nodeagent.tables import Keep, shorten_path, table, wrap

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
