"""The GPU commands' --json (issue 13, item 23): one versioned document each, as every other
read command prints (cli/output.py), every figure with its unit in its key. On simulated
nodes read by the command itself, and against the daemon's GPU routes on a real socket (a
shared reservation, a request waiting, processes outside any hold: every list the daemon's
view adds has an entry)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from test_cli import nodeagent
from test_gpu_operator import MIG, PAIRS, UUIDS, ask, reserve, start

from nodeagent.api import client
from nodeagent.gpualloc.service import GpuService

H100 = PAIRS.replace("4x-a100-two-nvlink-pairs", "dgx-h100-nvswitch")

UNITS = ("_bytes", "_percent", "_celsius", "_watts", "_seconds", "_fraction")
"""The units a GPU document's figures have (`_seconds` ends `_timestamp_seconds` too)."""
UNITLESS = {
    # counts
    "count",  # GPUs a request asks for
    "nvlinks",  # NVLink links between a pair
    # ids and indices
    "index",  # a GPU's or a MIG instance's NVML index
    "indices",  # GPU indices
    "minor",  # /dev/nvidiaN
    "numa_node",
    "numa_nodes",
    "cpu_numa_nodes",
    "gpus",  # a pair's two GPU indices
    "pid",
    "uid",
    # a placement's score: points (link scores plus the NUMA bonus), no physical unit
    "score",
    "pair_score",
    "numa_bonus_score",
    "best_possible_score",
}
"""Numbers without a unit in their key: counts, ids and indices, and the placement score.
Nothing else: a new figure needs its unit, or a reason here."""
OLD_NAMES = {
    "memory_total", "memory_used", "used_memory", "shared_memory", "utilization",
    "temperature_c", "power_draw_w", "power_limit_w", "power_min_w", "power_max_w",
    "power_default_w", "memory", "until", "fraction", "numa_bonus", "best_possible",
}  # fmt: skip
"""The daemon's names for these figures: none is in a document, even where its value is
null (a GPU without telemetry)."""


def figures_without_units(doc: object, path: str = "") -> list[str]:
    """The path of every number in `doc` whose key neither says its unit nor is unitless."""
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in figures_without_units(v, f"{path}.{k}")]
    if isinstance(doc, list):
        return [p for v in doc for p in figures_without_units(v, f"{path}[]")]
    if isinstance(doc, int | float) and not isinstance(doc, bool):
        key = path.rsplit(".", 1)[-1].removesuffix("[]").removesuffix("[]")
        return [] if key in UNITLESS or key.endswith(UNITS) else [path]
    return []


def keys(doc: object) -> set[str]:
    if isinstance(doc, dict):
        return set(doc) | {k for v in doc.values() for k in keys(v)}
    if isinstance(doc, list):
        return {k for v in doc for k in keys(v)}
    return set()


def assert_document(doc: dict[str, Any], kind: str) -> None:
    assert list(doc)[:2] == ["apiVersion", "kind"], doc
    assert (doc["apiVersion"], doc["kind"]) == ("nodeagent/v1", kind)
    assert figures_without_units(doc) == []
    assert keys(doc) & OLD_NAMES == set()


def json_of(*args: str, code: int = 0, **env: str) -> dict[str, Any]:
    proc = nodeagent(*args, "--json", **env)
    assert proc.returncode == code, proc.stderr
    doc = json.loads(proc.stdout)
    assert isinstance(doc, dict)
    return doc


def test_the_walker_finds_a_bare_figure() -> None:
    """The check itself: a figure without its unit is named, with where it is."""
    doc = {"items": [{"index": 0, "memory_total": 1, "power_limit_watts": 300.0}]}
    assert figures_without_units(doc) == [".items[].memory_total"]
    assert figures_without_units({"pairs": [{"gpus": [0, 1], "score": 10}]}) == []


@pytest.mark.parametrize("node", [PAIRS, MIG, H100], ids=["pairs", "mig", "h100"])
def test_gpus_on_a_simulated_node(node: str) -> None:
    doc = json_of("gpus", "--simulate", node)
    assert_document(doc, "GpuList")
    assert list(doc) == ["apiVersion", "kind", "source", "simulated", "reason", "items"]
    assert all(g["memory_total_bytes"] > 0 for g in doc["items"])


def test_gpus_shows_every_figure_of_the_pairs_node_with_its_unit() -> None:
    """Every key of a GPU with telemetry and of its compute process, in the report's order."""
    g0 = json_of("gpus", "--simulate", PAIRS)["items"][0]
    assert list(g0) == [
        "index", "uuid", "name", "pci_bus_id", "minor", "numa_node", "cpus", "healthy",
        "reason", "simulated", "memory_total_bytes", "memory_used_bytes",
        "utilization_percent", "temperature_celsius", "power_draw_watts", "power_limit_watts",
        "power_min_watts", "power_max_watts", "power_default_watts", "mig_enabled",
        "mig_devices", "processes",
    ]  # fmt: skip
    assert g0["processes"] == [
        {
            "pid": 31337,
            "device_uuid": UUIDS[0],
            "used_memory_bytes": 61 << 30,
            "cgroup": "nodeagent.slice/research-train",
        }
    ]
    mig = json_of("gpus", "--simulate", MIG)["items"][0]["mig_devices"][0]
    assert list(mig) == ["uuid", "index", "profile", "memory_total_bytes", "healthy", "reason"]


@pytest.mark.parametrize(
    "args",
    [
        ["-k", "2", "--numa", "0", "--simulate", H100],
        ["--shared", "--memory", "10Gi", "--simulate", PAIRS],
        ["--mig", "1g.10gb", "--simulate", MIG],
    ],
    ids=["nvswitch-numa", "shared-memory", "mig"],
)
def test_place_on_a_simulated_node(args: list[str]) -> None:
    doc = json_of("gpus", "place", *args)
    assert_document(doc, "GpuPlacement")
    assert doc["placed"] is True and 0 < doc["score_fraction"] <= 1


def test_place_when_nothing_fits_is_a_document_too() -> None:
    doc = json_of("gpus", "place", "-k", "3", "--simulate", PAIRS, code=1)
    assert_document(doc, "GpuPlacement")
    assert doc["placed"] is False


@pytest.fixture
def daemon() -> Iterator[tuple[GpuService, str]]:
    """The pairs node's daemon side with a shared reservation of 10Gi, and a request for 4
    GPUs waiting; GPUs 0 and 2 run processes outside any hold."""
    for service, sock in start(PAIRS):
        assert reserve(sock, "web", count=1, shared=True, memory=10 << 30, ttl=600)["uuids"]
        assert ask(sock, "big", count=4)["status"] == "waiting"
        yield service, sock


def test_gpus_against_the_daemon(daemon: tuple[GpuService, str]) -> None:
    _, sock = daemon
    doc = json_of("gpus", "--socket", sock)
    assert_document(doc, "GpuList")
    assert doc["queue"] and doc["queue"][0]["count"] == 4
    assigned = [(a["owner"], a["shared_memory_bytes"]) for g in doc["items"] for a in g["assigned"]]
    assert assigned == [("web", 10 << 30)]
    assert 4711 in [v["pid"] for g in doc["items"] for v in g["violations"]]
    answer = client.get(sock, "/v1/gpus")
    assert isinstance(answer, dict) and "memory_total" in answer["gpus"][0], (
        "the daemon's API keeps its names: only the CLI's document has units"
    )


def test_place_against_the_daemon(daemon: tuple[GpuService, str]) -> None:
    _, sock = daemon
    doc = json_of("gpus", "place", "--socket", sock, "--shared", "--memory", "10Gi")
    assert_document(doc, "GpuPlacement")
    assert doc["holds_considered"] is True and doc["request"]["memory_bytes"] == 10 << 30
    doc = json_of("gpus", "place", "--socket", sock, "--count", "3", code=1)
    assert_document(doc, "GpuPlacement")
    assert doc["placed"] is False


def test_reserve_json_and_format_json_print_one_document(daemon: tuple[GpuService, str]) -> None:
    _, sock = daemon
    doc = json_of("gpus", "reserve", "--socket", sock, "--name", "one")
    assert_document(doc, "GpuReservation")
    assert list(doc)[:2] == ["apiVersion", "kind"]
    assert set(doc) == {
        "apiVersion", "kind", "name", "uuids", "indices", "score", "score_fraction",
        "until_timestamp_seconds", "container",
    }  # fmt: skip
    proc = nodeagent("gpus", "reserve", "--socket", sock, "--name", "two", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    same = json.loads(proc.stdout)
    assert_document(same, "GpuReservation")
    assert list(same) == list(doc), "--format json prints what --json does"
    assert {doc["uuids"][0], same["uuids"][0]} <= set(UUIDS)
    assert same["uuids"] != doc["uuids"]
