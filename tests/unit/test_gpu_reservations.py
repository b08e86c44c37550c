"""GPU reservations through the daemon's own routes (`/v1/gpus/reservations`): what a
reservation holds and for how long, what it keeps from others, what is refused, what is
audited, and what a restart keeps. Who may act on whose reservation is test_cross_user's;
the CLI is test_gpu_reserve_cli's.

The daemon runs on a plain directory tree with a simulated 2-GPU node (stand-ins, see
daemon_api); callers are Peer records as SO_PEERCRED gives them.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
from daemon_api import ALICE, CID, ROOT, Daemon, FilesTree, daemon, restart
from structlog.testing import capture_logs

from nodeagent.daemon import open_agent
from nodeagent.errors import BadRequest, Conflict
from nodeagent.gpu.model import HoldKind

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"
RESERVATIONS = "/v1/gpus/reservations"


@pytest.fixture
def d(tmp_path: Path) -> Daemon:
    return daemon(tmp_path)


def reserve(d: Daemon, peer: Any, name: str, count: int = 1, **body: Any) -> dict[str, Any]:
    got: dict[str, Any] = d.call(peer, "POST", RESERVATIONS, {"name": name, "count": count, **body})
    return got


def audited(logs: Iterable[Mapping[str, Any]], event: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] == event]


def assigned(d: Daemon) -> dict[str, list[tuple[str, str, int]]]:
    """Per GPU uuid, who `GET /v1/gpus` says holds it: (owner, kind, uid)."""
    return {
        g["uuid"]: [(a["owner"], a["kind"], a["uid"]) for a in g["assigned"]]
        for g in d.call(ROOT, "GET", "/v1/gpus")["gpus"]
    }


def test_a_reservation_holds_its_gpus_from_requests_until_released(d: Daemon) -> None:
    before = time.time()
    with capture_logs() as logs:
        got = reserve(d, ALICE, "web", ttl="10m")
    assert (got["name"], got["container"], len(got["uuids"])) == ("web", None, 1)
    (held,) = got["uuids"]
    assert got["indices"] == [[GPU0, GPU1].index(held)]
    assert before + 600 <= got["until"] <= time.time() + 600
    (event,) = audited(logs, "gpu.reserved")
    assert [event[k] for k in ("owner", "uid", "uuids", "ttl")] == ["web", 1000, [held], 600]
    (hold,) = d.agent.rec.gpus.ledger.holds()
    spec = d.agent.rec.spec.jobs
    assert (hold.kind, hold.uid, hold.tenant, hold.workload_class) == (
        HoldKind.RESERVATION,
        1000,
        spec.default_tenant,
        str(spec.default_class),
    )
    assert assigned(d)[held] == [("web", "reservation", 1000)]
    # what placement sees now: only the other GPU; a request for both waits
    (other,) = {GPU0, GPU1} - {held}
    assert d.call(ROOT, "GET", "/v1/gpus/place", query={"count": "1"})["uuids"] == [other]
    two = d.ask(ROOT, "two", 2)
    assert two["status"] == "waiting"
    with capture_logs() as logs:
        assert d.call(ALICE, "DELETE", RESERVATIONS, {"name": "web"}) == {"released": "web"}
    (event,) = audited(logs, "gpu.released")
    assert (event["owner"], event["uuids"], event["reason"]) == (
        "web",
        [held],
        "released by request",
    )
    d.agent.tick()  # the queue is served with what the release freed
    status = d.call(ROOT, "GET", "/v1/gpus/requests", query={"id": two["id"]})
    assert (status["status"], sorted(status.get("uuids", []))) == ("granted", [GPU0, GPU1])


def test_an_unbound_reservation_lapses_after_its_ttl_and_a_bound_one_does_not(d: Daemon) -> None:
    reserve(d, ALICE, "soon", ttl=30)
    reserve(d, ALICE, "web", container=CID, ttl=30)
    d.run_in(ALICE, f"system.slice/docker-{CID}.scope")  # alice's container
    d.agent.rec.registry.resync()
    d.agent.tick()  # binds "web" to its container: it follows the cgroup from now on
    assert {h.owner: h.cgroup for h in d.agent.rec.gpus.ledger.holds()} == {
        "soon": None,
        "web": f"system.slice/docker-{CID}.scope",
    }
    now = time.monotonic()
    d.agent.rec.gpus.sense(now + 25)
    assert d.holds() == [("soon", "reservation"), ("web", "reservation")], "not yet"
    with capture_logs() as logs:
        d.agent.rec.gpus.sense(now + 31)
    assert d.holds() == [("web", "reservation")]
    assert [(e["owner"], e["reason"]) for e in audited(logs, "gpu.released")] == [
        ("soon", "not claimed in time")
    ]
    d.agent.rec.gpus.sense(now + 10 * 24 * 3600)
    assert d.holds() == [("web", "reservation")], "a bound reservation has no ttl"


def test_a_reservation_that_does_not_fit_now_or_ever_is_refused_and_holds_nothing(
    d: Daemon,
) -> None:
    reserve(d, ROOT, "both", 2)
    e = d.refused(ALICE, "POST", RESERVATIONS, {"name": "more", "count": 1})
    assert isinstance(e, Conflict) and str(e).startswith("no GPUs fit now: ")
    e = d.refused(ALICE, "POST", RESERVATIONS, {"name": "huge", "count": 3})
    assert isinstance(e, BadRequest)
    assert str(e).endswith("; the request can never be placed here")
    assert d.holds() == [("both", "reservation")]


def test_a_reservation_and_its_time_left_survive_a_restart(d: Daemon) -> None:
    got = reserve(d, ALICE, "web", ttl=600)
    d.agent.save_state()
    again = restart(d)
    (hold,) = again.agent.rec.gpus.ledger.holds()
    assert (hold.owner, hold.kind, hold.uid, list(hold.uuids)) == (
        "web",
        HoldKind.RESERVATION,
        1000,
        got["uuids"],
    )
    assert hold.until is not None
    assert 590 < hold.until - time.monotonic() <= 600, "the ttl runs on, it does not restart"


def test_a_reservation_that_could_bind_to_two_containers_binds_to_neither_until_one(
    d: Daemon,
) -> None:
    """A reservation names its container by a 12-digit prefix that two containers' ids
    share: binding to either would give one of them GPUs meant for the other, and which
    one would hang on discovery's order. It binds to neither, says so once (not every
    tick), and binds to the one left when the other goes; a reservation naming the full
    id binds to exactly that container even while its prefix matches both."""
    twin = CID[:12] + "f" * (len(CID) - 12)
    reserve(d, ALICE, "web", container=CID[:12], ttl=600)
    reserve(d, ALICE, "exact", container=twin, ttl=600)
    d.run_in(ALICE, f"system.slice/docker-{CID}.scope", f"system.slice/docker-{twin}.scope")
    d.agent.rec.registry.resync()
    with capture_logs() as logs:
        d.agent.tick()
        d.agent.tick()
    bound = {h.owner: h.cgroup for h in d.agent.rec.gpus.ledger.holds()}
    assert bound == {"web": None, "exact": f"system.slice/docker-{twin}.scope"}
    (warned,) = audited(logs, "gpu.reservation_ambiguous")
    assert (warned["reservation"], sorted(warned["matches"])) == (
        "web",
        sorted([f"system.slice/docker-{CID}.scope", f"system.slice/docker-{twin}.scope"]),
    )
    shutil.rmtree(d.root / f"system.slice/docker-{twin}.scope")
    d.agent.rec.registry.resync()
    d.agent.tick()
    bound = {h.owner: h.cgroup for h in d.agent.rec.gpus.ledger.holds()}
    assert bound == {"web": f"system.slice/docker-{CID}.scope"}  # "exact" went with its own


def test_a_restarted_daemon_answers_with_its_restored_holds_before_its_first_tick(
    d: Daemon,
) -> None:
    """The API serves before the first tick; the GPU view it reads is published once the
    state is restored (Reconciler.publish), not at the first tick's end."""
    reserve(d, ROOT, "kept")
    d.agent.save_state()
    again = open_agent(d.agent.rec.spec, FilesTree(str(d.root)))
    held = [h.owner for h in again.rec.gpus.view.holds()]
    assert held == ["kept"], "restored, and published before any tick"
