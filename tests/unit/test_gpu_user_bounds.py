"""Every member's share of the GPUs is bounded, and a reservation stands only for its own
uid's workload (issue 34, items 5 and 6), through the daemon's own routes.

5: one member reserved both GPUs for 7 days and another got "no GPUs fit now"; unclaimed
grants were uncapped the same way. Each uid but root now has gpu.max_holds_per_user
reservations and unclaimed grants, and gpu.max_held_gpu_hours_per_user GPU-hours ahead of
use (their defaults here: 4 and 24).
6: a member bound their reservation to another user's container, and that container's own
processes became violators (frozen with gpu.on_violation: freeze). A reservation now binds
only to its uid's workload (or one root names), and a process is judged against every hold
bound to its cgroup.

The daemon runs on a plain directory tree with a simulated 2-GPU node, the callers are
Peer records as SO_PEERCRED gives them, and a container's processes are a fake /proc's
(stand-ins, see daemon_api). The real-kernel, real-uid repro of 6 is
tests/kernel/test_gpu_cross_user.py's.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from daemon_api import ALICE, BOB, CID, GPUS, ROOT, Daemon, daemon
from structlog.testing import capture_logs
from test_gpu_reservations import RESERVATIONS, reserve

from nodeagent.errors import Conflict
from nodeagent.gpu.model import GpuProcess, Hold, HoldKind
from nodeagent.gpu.simulated import parse_node
from nodeagent.policy.gpu_checks import violations

ATTACH = "/v1/gpus/reservations/container"
ALICES = f"system.slice/docker-{CID}.scope"


@pytest.fixture
def d(tmp_path: Path) -> Daemon:
    return daemon(tmp_path)


def bound(d: Daemon) -> dict[str, str | None]:
    return {h.owner: h.cgroup for h in d.agent.rec.gpus.ledger.holds()}


# --- 5: per-uid bounds on reservations and grants -------------------------------------------


def test_one_member_cannot_reserve_every_gpu_for_a_week(d: Daemon) -> None:
    e = d.refused(BOB, "POST", RESERVATIONS, {"name": "hog", "count": 2, "ttl": "7d"})
    assert isinstance(e, Conflict)
    assert str(e) == (
        "reservation 'hog' refused: uid 1001 would hold 336.0 GPU-hours ahead of use, more"
        " than gpu.max_held_gpu_hours_per_user (24) allows; ask for fewer GPUs or a shorter"
        " time to live, or release a reservation"
    )
    assert d.holds() == []
    reserve(d, BOB, "day", ttl="12h")  # 12 GPU-hours
    e = d.refused(BOB, "POST", RESERVATIONS, {"name": "more", "ttl": "13h"})  # 25 in all
    assert isinstance(e, Conflict) and "gpu.max_held_gpu_hours_per_user (24)" in str(e)
    e = d.refused(ALICE, "POST", RESERVATIONS, {"name": "mine", "ttl": "7d"})  # 168
    assert isinstance(e, Conflict) and str(e).startswith("reservation 'mine' refused: uid 1000")
    reserve(d, ALICE, "mine", ttl="1d")  # the GPU bob did not take is hers for a day
    assert d.holds() == [("day", "reservation"), ("mine", "reservation")]
    for name, peer in (("day", BOB), ("mine", ALICE)):
        d.call(peer, "DELETE", RESERVATIONS, {"name": name})
    reserve(d, ROOT, "ops", 2, ttl="7d")  # the operator is not bounded
    assert d.holds() == [("ops", "reservation")]


def test_a_members_reservations_are_counted(d: Daemon) -> None:
    shared: dict[str, Any] = {"shared": True, "memory": 1 << 30, "ttl": "1h"}
    for i in range(4):
        reserve(d, BOB, f"r{i}", **shared)
    e = d.refused(BOB, "POST", RESERVATIONS, {"name": "r4", "count": 1, **shared})
    assert isinstance(e, Conflict)
    assert str(e) == (
        "reservation 'r4' refused: uid 1001 holds 4 reservations and unclaimed grants, the"
        " most gpu.max_holds_per_user allows; release one"
    )
    d.call(BOB, "DELETE", RESERVATIONS, {"name": "r0"})
    reserve(d, BOB, "r4", **shared)  # one went: room for one
    reserve(d, ALICE, "a0", **shared)  # another uid's count is its own
    assert sorted(o for o, _ in d.holds()) == ["a0", "r1", "r2", "r3", "r4"]


def test_a_members_unclaimed_grants_are_counted_and_the_next_request_waits(d: Daemon) -> None:
    shared: dict[str, Any] = {"shared": True, "memory": 1 << 30}
    for i in range(4):
        assert d.ask(BOB, f"g{i}", 1, **shared)["status"] == "granted"
    late = d.ask(BOB, "g4", 1, **shared)
    assert (late["status"], late["reason"]) == (
        "waiting",
        "uid 1001 holds 4 reservations and unclaimed grants, the most"
        " gpu.max_holds_per_user allows; release one",
    )
    assert d.ask(ALICE, "a0", 1, **shared)["status"] == "granted"  # the same shape fits her
    assert d.ask(ROOT, "ops", 1, **shared)["status"] == "granted"
    first = d.agent.rec.gpus.ledger.queue()[0]
    assert first.owner == "g4"
    # one of bob's grants goes back: his waiting request is granted at the next step
    granted = d.agent.rec.gpus.view.ledger.granted.values()
    g0 = next(a.id for a in granted if a.hold is not None and a.hold.owner == "g0")
    d.call(BOB, "DELETE", "/v1/gpus/requests", {"id": g0})
    d.call(BOB, "GET", "/v1/gpus/requests", query={"id": late["id"]})  # still asked about
    d.agent.tick()
    assert d.call(BOB, "GET", "/v1/gpus/requests", query={"id": late["id"]})["status"] == "granted"


def test_by_default_a_members_job_may_hold_every_gpu(d: Daemon) -> None:
    """The GPU-hours bound is on what no job uses yet: a job's GPUs are in use for as long
    as it runs, and without gpu.max_gpus_per_user one member's job holds both GPUs (the
    bound below is the operator's to set)."""
    granted = d.ask(BOB, "train", 2)
    assert granted["status"] == "granted"
    d.start(BOB, "train", gpu_request=granted["id"])
    assert d.holds() == [("train", "job")]


def test_with_max_gpus_per_user_jobs_reservations_and_grants_share_one_bound(
    tmp_path: Path,
) -> None:
    """Item 5 tried again through a job: bob's job held both GPUs of the node for as long as
    it ran, as much as a 7-day reservation would have. With gpu.max_gpus_per_user 1, a
    member's job, reservation and unclaimed grant count alike: one GPU in all, whatever
    their kind; more on one request is refused when asked, more beside it waits (or, for a
    reservation, is refused), the other member and root are not held back, and the waiting
    request is granted once the job ends."""
    d = daemon(tmp_path, {"gpu": {"max_gpus_per_user": 1}})
    e = d.refused(BOB, "POST", "/v1/gpus/requests", {"name": "both", "count": 2})
    assert isinstance(e, Conflict)
    assert str(e) == (
        "request 'both' asks for 2 GPUs; one uid may hold 1 at once (gpu.max_gpus_per_user),"
        " so it could never be granted"
    )
    granted = d.ask(BOB, "train", 1)
    d.start(BOB, "train", gpu_request=granted["id"])
    more = (
        "uid 1001 holds 1 GPUs (jobs, reservations and grants); 1 more would pass"
        " gpu.max_gpus_per_user (1); release one or wait for a job to end"
    )
    late = d.ask(BOB, "second", 1)
    assert (late["status"], late["reason"]) == ("waiting", more)
    e = d.refused(BOB, "POST", RESERVATIONS, {"name": "r", "count": 1, "ttl": "1h"})
    assert isinstance(e, Conflict) and str(e) == f"reservation 'r' refused: {more}"
    e = d.refused(ALICE, "POST", RESERVATIONS, {"name": "big", "count": 2, "ttl": "1h"})
    assert isinstance(e, Conflict) and str(e) == (
        "reservation 'big' refused: 2 GPUs are more than gpu.max_gpus_per_user (1) lets one"
        " uid hold at once; ask for fewer"
    )
    hers = d.ask(ALICE, "hers", 1)
    assert hers["status"] == "granted"  # the other GPU: her bound is her own
    d.call(ALICE, "DELETE", "/v1/gpus/requests", {"id": hers["id"]})
    reserve(d, ROOT, "ops", 1, ttl="1h")  # root is not bounded
    d.call(ROOT, "DELETE", RESERVATIONS, {"name": "ops"})
    d.exit("train")
    d.agent.tick()  # the job ends: its GPU goes back, and bob's waiting request is served
    d.call(BOB, "GET", "/v1/gpus/requests", query={"id": late["id"]})
    d.agent.tick()
    answer = d.call(BOB, "GET", "/v1/gpus/requests", query={"id": late["id"]})
    assert answer["status"] == "granted"


# --- 6: a reservation binds only to its own uid's workload ----------------------------------


def processes(d: Daemon, *lines: str) -> None:
    """The simulated GPUs' compute processes from now on (a labelled fake)."""
    yaml = GPUS + "processes:\n" + "".join(f"  - {line}\n" for line in lines)
    d.agent.rec.gpus.backend._node = parse_node(textwrap.dedent(yaml), "procs.yaml")  # type: ignore[attr-defined]


def test_a_member_cannot_bind_a_reservation_to_another_users_container(d: Daemon) -> None:
    """bob reserves first (his hold is the ledger's first), alice reserves for her own
    container, and bob attaches his reservation to that container: it is not bound (said
    once), and alice's process on her own GPU is no violator."""
    bob = reserve(d, BOB, "bob-early")
    alice = reserve(d, ALICE, "alice-web", container=CID)
    d.run_in(ALICE, ALICES)
    d.agent.rec.registry.resync()
    d.call(BOB, "POST", ATTACH, {"name": "bob-early", "container": CID})
    (gpu,) = alice["indices"]
    processes(d, f"{{pid: 8101, gpu: {gpu}, memory: 1Gi, cgroup: {ALICES}}}")
    with capture_logs() as logs:
        d.agent.tick()
        d.agent.tick()
    assert bound(d) == {"bob-early": None, "alice-web": ALICES}
    (said,) = [e for e in logs if e["event"] == "gpu.reservation_not_owned"]
    assert (said["reservation"], said["uid"], said["workloads"]) == ("bob-early", 1001, [ALICES])
    found = [v for g in d.call(ROOT, "GET", "/v1/gpus")["gpus"] for v in g["violations"]]
    assert found == []
    assert bob["indices"] != alice["indices"]


def test_only_root_names_a_container_that_is_not_the_members_own(d: Daemon) -> None:
    """A container whose processes run as root (a rootful runtime's) is the operator's: a
    member's reservation binds to it only once root names it; a member's own naming of it
    binds nothing."""
    reserve(d, ALICE, "web")
    d.call(ALICE, "POST", ATTACH, {"name": "web", "container": CID})
    d.run_in(ROOT, ALICES)
    d.agent.rec.registry.resync()
    d.agent.tick()
    assert bound(d) == {"web": None}
    d.call(ROOT, "POST", ATTACH, {"name": "web", "container": CID})
    d.agent.tick()
    assert bound(d) == {"web": ALICES}


def test_a_hold_bound_beside_the_owners_never_makes_its_process_a_violator() -> None:
    """Two holds bound to one cgroup (a state file from before, or the operator's doing):
    the process is judged against both, not the first alone."""
    from test_gpu_policies import G0, G1, state

    theirs = Hold("bob-early", HoldKind.RESERVATION, (G1,), (1,), cgroup=ALICES, uid=1001)
    own = Hold("alice-web", HoldKind.RESERVATION, (G0,), (0,), cgroup=ALICES, uid=1000)
    on_own = GpuProcess(8101, G0, 1 << 30, ALICES)
    assert violations(state((on_own,), (theirs, own))) == []
