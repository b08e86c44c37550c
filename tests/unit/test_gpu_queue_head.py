"""The GPUs kept for the head of the queue (EASY backfill, issue 38 item 1) as operators see
them: /v1/gpus's queue (`kept`, `expected_start`), `nodeagent gpus`' STARTS column, the
metrics, and `explain` of a job placed on kept GPUs. On the simulated DGX H100
(config/gpus/, a labelled stand-in: no GPU here)."""

from __future__ import annotations

import time
from typing import cast

from test_gpu_view import call, served, service
from test_metrics import scrape, value, values

from nodeagent.api.answers import Explanation, GpuList, GpuUse
from nodeagent.cli.gpus import _gpus_table
from nodeagent.cli.inspection import _explain_gpus
from nodeagent.gpu.model import Hold, HoldKind
from nodeagent.metrics.collector import TickCollector
from nodeagent.routes.agent import _gpu_use


def test_the_head_of_the_queue_shows_its_kept_gpus_and_expected_start() -> None:
    gpus = service()
    routes = served(gpus)
    soon = time.time() + 600  # a declared duration: its deadline, ten minutes away
    six = call(routes, "POST", "/v1/gpus/requests", uid=0, name="six", count=6, deadline=soon)
    big = call(routes, "POST", "/v1/gpus/requests", uid=1001, name="big", count=8)
    small = call(routes, "POST", "/v1/gpus/requests", uid=1002, name="small", count=1)
    assert (six["status"], big["status"], small["status"]) == ("granted", "waiting", "waiting")

    assert abs(big["expected_start"] - soon) < 5, "its ask says when it is expected to start"
    assert small.get("expected_start") is None
    got = call(routes, "GET", "/v1/gpus/requests", uid=1001, query={"id": big["id"]})
    assert abs(got["expected_start"] - soon) < 5, "and so does its status"

    report = call(routes, "GET", "/v1/gpus", uid=1002)
    head, behind = report["queue"]
    assert (head["owner"], head["kept"]) == ("big", list(range(8)))
    assert head["expected_start"] is not None
    assert abs(head["expected_start"] - soon) < 5, "when six's hold is expected back"
    assert head["reason"] == (
        "no 8 GPUs free now: 2 of 8 eligible (6 held); first in line: GPUs 0, 1, 2, 3, 4, 5,"
        " 6, 7 are kept for it, expected free when six ends"
    )
    assert (behind["owner"], behind["kept"], behind["expected_start"]) == ("small", [], None)
    assert "are kept for big, first in line" in behind["reason"], "small: no declared end"

    text = _gpus_table(GpuList.model_validate(report), width=80)
    assert "STARTS" in text
    row = next(line for line in text.splitlines() if " big " in line)
    assert " in 9m " in row or " in 10m " in row, row
    assert all(len(line) <= 80 for line in text.splitlines()), text

    c = TickCollector()
    c.watch_gpus(gpus.backend, lambda: gpus.view.ledger)
    s = scrape(c)
    assert sorted(values(s, "nodeagent_gpu_kept_for_queue_head", owner="big")) == [1.0] * 8
    start = value(s, "nodeagent_gpu_queue_head_expected_start_timestamp_seconds", owner="big")
    assert abs(start - soon) < 5
    assert value(s, "nodeagent_gpu_requests_waiting", **{"class": "batch"}) == 2


def test_explain_says_a_jobs_gpus_are_kept_for_the_head_of_the_queue() -> None:
    gpus = service()
    routes = served(gpus)
    soon = time.time() + 600
    call(routes, "POST", "/v1/gpus/requests", uid=0, name="six", count=6, deadline=soon)
    call(routes, "POST", "/v1/gpus/requests", uid=1001, name="big", count=8)
    quick = call(
        routes, "POST", "/v1/gpus/requests", uid=0, name="quick", count=1,
        deadline=time.time() + 60,
    )  # fmt: skip
    assert quick["status"] == "granted", "back before the head's start: on a kept GPU"
    hold = next(h for h in gpus.ledger.holds() if h.owner == "quick")
    claimed = Hold(
        owner="quick", kind=HoldKind.JOB, uuids=hold.uuids, indices=hold.indices,
        cgroup="managed/quick", expected_end=hold.expected_end, id=hold.id, uid=0,
    )  # fmt: skip
    gpus.ledger._holds[hold.id] = claimed  # as its job's claim leaves it
    gpus.publish()
    use = _gpu_use(gpus.view, "managed/quick")
    assert use is not None
    assert (use["indices"], use["kept_for"]) == (list(hold.indices), "big")
    assert isinstance(use["kept_from"], float) and abs(use["kept_from"] - soon) < 5
    assert _gpu_use(gpus.view, "managed/other") is None
    shown = _explain_gpus(cast(Explanation, Shown(GpuUse.model_validate(use))), time.time())
    assert shown[0].startswith(f"  gpus: {hold.indices[0]} (expected back: in ")
    assert shown[1].startswith("  kept for big, first in line (its expected start: in 9m")


class Shown:
    """What `_explain_gpus` reads of an explanation."""

    def __init__(self, gpus: GpuUse) -> None:
        self.gpus = gpus
