"""Who may touch whose GPUs and jobs, through the daemon's own routes (issue 12, items 1-8).

Each test is a repro from the issue, as uid 1000 (alice), uid 1001 (bob) and root calling
a daemon on a plain directory tree with a simulated 2-GPU node (stand-ins, see daemon_api).
"""

from __future__ import annotations

import re
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_api import ALICE, BOB, CID, ROOT, Daemon, daemon, mkdirs

from nodeagent.errors import BadRequest, Conflict, Forbidden, NotFound, Refused
from nodeagent.gpu.simulated import parse_node
from nodeagent.gpualloc import ledger as ledger_module
from nodeagent.gpualloc.placement import GpuRequest, Holdings, NodeGpus, Placement, Refusal, place
from nodeagent.jobs import Job


@pytest.fixture
def d(tmp_path: Path) -> Daemon:
    return daemon(tmp_path)


def gpu_job(d: Daemon, peer: Any, name: str, count: int = 1, **body: Any) -> dict[str, Any]:
    """`exec --name NAME --gpus COUNT` as `peer`: ask, then start claiming the grant."""
    grant = d.ask(peer, name, count, **body)
    assert grant["status"] == "granted", grant
    job: dict[str, Any] = d.start(peer, name, gpu_request=grant["id"], **body)
    return job


def refused_start(d: Daemon, peer: Any, name: str, **body: Any) -> Refused:
    return d.refused(peer, "POST", "/v1/jobs", {"name": name, "pid": d.child(peer), **body})


def reserve(d: Daemon, peer: Any, name: str, count: int = 1, **body: Any) -> dict[str, Any]:
    got: dict[str, Any] = d.call(
        peer, "POST", "/v1/gpus/reservations", {"name": name, "count": count, **body}
    )
    return got


def unreserve(d: Daemon, peer: Any, name: str) -> Any:
    return d.call(peer, "DELETE", "/v1/gpus/reservations", {"name": name})


# --- 1: releasing someone else's GPUs -------------------------------------------------------


def test_a_running_jobs_gpus_cannot_be_released_by_name(d: Daemon) -> None:
    gpu_job(d, BOB, "train")
    for peer in (ALICE, BOB, ROOT):  # not even its own uid or root: it goes when the job ends
        e = d.refused(peer, "DELETE", "/v1/gpus/reservations", {"name": "train"})
        assert isinstance(e, Conflict) and "only reservations are released by name" in str(e)
    assert d.holds() == [("train", "job")]
    # alice cannot get bob's GPU: one of two is left
    assert d.ask(ALICE, "more", 2)["status"] == "waiting"


def test_a_reservation_is_released_only_by_its_uid_or_root(d: Daemon) -> None:
    reserve(d, BOB, "web-1")
    reserve(d, BOB, "web-2")
    e = d.refused(ALICE, "DELETE", "/v1/gpus/reservations", {"name": "web-1"})
    assert isinstance(e, Forbidden) and str(e) == "reservation 'web-1' belongs to uid 1001"
    assert unreserve(d, BOB, "web-1") == {"released": "web-1"}
    assert unreserve(d, ROOT, "web-2") == {"released": "web-2"}
    assert d.holds() == []
    e = d.refused(BOB, "DELETE", "/v1/gpus/reservations", {"name": "web-1"})
    assert isinstance(e, NotFound)


# --- 2: request ids -------------------------------------------------------------------------


def test_request_ids_are_unguessable_and_only_their_asker_uses_them(d: Daemon) -> None:
    mine = d.ask(ALICE, "a-job")
    assert mine["status"] == "granted"
    rid = mine["id"]
    assert not re.fullmatch(r"r\d+", rid) and len(rid) >= 20
    query = {"id": rid}
    e = d.refused(BOB, "GET", "/v1/gpus/requests", query=query)
    assert isinstance(e, Forbidden) and "belongs to uid 1000" in str(e)
    e = d.refused(BOB, "DELETE", "/v1/gpus/requests", {"id": rid})
    assert isinstance(e, Forbidden)
    e = d.refused(BOB, "POST", "/v1/jobs", {"name": "b", "pid": d.child(BOB), "gpu_request": rid})
    assert isinstance(e, Forbidden)
    assert d.jobs() == [] and d.holds() == [("a-job", "request")]
    # the asker and root may
    assert d.call(ALICE, "GET", "/v1/gpus/requests", query=query)["status"] == "granted"
    assert d.call(ROOT, "GET", "/v1/gpus/requests", query=query)["status"] == "granted"
    d.start(ALICE, "a-job", gpu_request=rid)
    assert d.holds() == [("a-job", "job")]


def test_a_waiting_request_is_cancelled_only_by_its_asker(d: Daemon) -> None:
    d.ask(ALICE, "all", 2)
    waiting = d.ask(ALICE, "later", 1)
    assert waiting["status"] == "waiting"
    e = d.refused(BOB, "DELETE", "/v1/gpus/requests", {"id": waiting["id"]})
    assert isinstance(e, Forbidden)
    assert [w.owner for w in d.agent.rec.gpus.ledger.queue()] == ["later"]
    d.call(ALICE, "DELETE", "/v1/gpus/requests", {"id": waiting["id"]})
    assert d.agent.rec.gpus.ledger.queue() == []


def test_the_queue_shows_request_ids_to_their_asker_and_root_only(d: Daemon) -> None:
    d.ask(ALICE, "all", 2)
    rid = d.ask(ALICE, "later", 1)["id"]
    seen = {p.uid: d.call(p, "GET", "/v1/gpus")["queue"][0]["id"] for p in (ALICE, BOB, ROOT)}
    assert seen == {1000: rid, 1001: None, 0: rid}


# --- 3: one namespace of names --------------------------------------------------------------


def test_a_job_without_gpus_releases_no_reservation_of_its_name(d: Daemon) -> None:
    reserve(d, ALICE, "web-1")
    d.start(BOB, "web-1")
    d.exit("web-1")
    d.call(BOB, "DELETE", "/v1/jobs", {"name": "web-1", "exit_status": 0})
    assert d.jobs() == []
    assert d.holds() == [("web-1", "reservation")]


def test_a_name_held_by_another_hold_is_refused(d: Daemon) -> None:
    reserve(d, ALICE, "big", 1)
    # bob asks under another name, then starts his job under the reservation's name
    grant = d.ask(BOB, "x")
    e = refused_start(d, BOB, "big", gpu_request=grant["id"])
    assert isinstance(e, Conflict) and "'big' is taken" in str(e)
    e = d.refused(BOB, "POST", "/v1/gpus/requests", {"name": "big"})
    assert isinstance(e, Conflict)
    e = d.refused(BOB, "POST", "/v1/gpus/reservations", {"name": "big"})
    assert isinstance(e, Conflict)
    assert d.holds() == [("big", "reservation"), ("x", "request")]
    assert d.jobs() == [] and not (d.root / "nodeagent.slice" / "big").exists()


# --- 4: a reservation binds only to the container it names --------------------------------

STRANGER = """\
processes:
  - {pid: 7001, gpu: 0, memory: 1Gi, cgroup: user.slice/user-1001.slice/session-3.scope}
"""


def test_a_reservation_binds_only_to_its_named_container(tmp_path: Path) -> None:
    from daemon_api import GPUS

    d = daemon(tmp_path, gpus=GPUS)
    mkdirs(d.root, "user.slice/user-1001.slice/session-3.scope")  # the stranger's session
    got = reserve(d, ROOT, "web", 2, container=CID[:12])
    # then the stranger starts a CUDA process on a reserved GPU, to capture the reservation
    # (a GPU busy before the reserve would not be placed at all)
    backend = d.agent.rec.gpus.backend
    stranger = parse_node(textwrap.dedent(GPUS + STRANGER), "stranger.yaml")
    backend._node = stranger  # type: ignore[attr-defined]
    d.agent.tick()
    (hold,) = d.agent.rec.gpus.ledger.holds()
    assert hold.cgroup is None, "not captured by the first process on its GPUs"
    assert got["container"] == CID[:12]
    violations = [v for g in d.call(ROOT, "GET", "/v1/gpus")["gpus"] for v in g["violations"]]
    assert [(v["pid"], v["kind"]) for v in violations] == [(7001, "unassigned")]
    # another user's delegated subtree holds a cgroup named like the container: not bound
    theirs = f"user.slice/user-1001.slice/user@1001.service/app.slice/libpod-{CID}.scope"
    mkdirs(d.root, theirs)
    d.agent.rec.registry.resync()
    d.agent.tick()
    assert d.agent.rec.gpus.ledger.holds()[0].cgroup is None
    # the container itself appears: bound to it
    real = f"system.slice/docker-{CID}.scope"
    mkdirs(d.root, real)
    d.agent.rec.registry.resync()
    d.agent.tick()
    assert d.agent.rec.gpus.ledger.holds()[0].cgroup == real
    # and released when it goes
    shutil.rmtree(d.root / real)
    d.agent.rec.registry.resync()
    d.agent.tick()
    assert d.holds() == []


def test_a_users_reservation_binds_in_their_own_subtree_only(d: Daemon) -> None:
    mine = f"user.slice/user-1001.slice/user@1001.service/app.slice/libpod-{CID}.scope"
    mkdirs(d.root, mine, "user.slice/user-1001.slice/session-3.scope")
    d.agent.rec.registry.resync()
    reserve(d, BOB, "pod", container=CID)
    reserve(d, ALICE, "same", container=CID)
    d.agent.tick()
    bound = {h.owner: h.cgroup for h in d.agent.rec.gpus.ledger.holds()}
    assert bound == {"pod": mine, "same": None}


def test_a_reservation_without_a_container_is_named_later_by_its_uid(d: Daemon) -> None:
    reserve(d, ALICE, "web")
    attach = "/v1/gpus/reservations/container"
    e = d.refused(BOB, "POST", attach, {"name": "web", "container": CID})
    assert isinstance(e, Forbidden)
    d.call(ALICE, "POST", attach, {"name": "web", "container": CID})
    d.run_in(ALICE, f"system.slice/docker-{CID}.scope")  # alice's own container
    d.agent.rec.registry.resync()
    d.agent.tick()
    assert d.agent.rec.gpus.ledger.holds()[0].cgroup == f"system.slice/docker-{CID}.scope"


# --- 5: tenants of GPU requests -------------------------------------------------------------


def test_an_unknown_tenant_cannot_ask_for_gpus(d: Daemon) -> None:
    e = d.refused(ROOT, "POST", "/v1/gpus/requests", {"name": "x", "tenant": "nobody-knows"})
    assert isinstance(e, BadRequest) and "unknown tenant 'nobody-knows'" in str(e)
    assert d.holds() == []


def test_a_grant_is_claimed_only_for_its_tenant_and_class(d: Daemon) -> None:
    grant = d.ask(ROOT, "t", tenant="research", **{"class": "batch"})
    for other in ({"tenant": "prod"}, {"class": "inference"}):
        e = refused_start(d, ROOT, "t", gpu_request=grant["id"], **other)
        assert isinstance(e, Conflict) and "was granted for tenant 'research'" in str(e)
    d.start(ROOT, "t", gpu_request=grant["id"], tenant="research", **{"class": "batch"})
    (hold,) = d.agent.rec.gpus.ledger.holds()
    assert (hold.tenant, hold.workload_class, hold.kind) == ("research", "batch", "job")


# --- 6: who may use which tenant and class --------------------------------------------------


def test_a_user_without_an_entry_gets_the_defaults_only(d: Daemon) -> None:
    deadline = time.time() + 3600
    body = {"tenant": "prod", "class": "inference", "deadline": deadline, "work": 60}
    e = d.refused(ALICE, "POST", "/v1/jobs", {"name": "x", "pid": d.child(ALICE), **body})
    assert isinstance(e, Forbidden)
    assert str(e).startswith("uid 1000")
    assert "may not use tenant 'prod' with class inference" in str(e)
    for path in ("/v1/gpus/requests", "/v1/gpus/reservations"):
        e = d.refused(ALICE, "POST", path, {"name": "x", "tenant": "prod"})
        assert isinstance(e, Forbidden)
    assert d.jobs() == [] and d.holds() == []
    d.start(ALICE, "defaults")  # research/batch
    d.start(ROOT, "root", tenant="prod", **{"class": "inference"})
    assert d.jobs() == ["defaults", "root"]


def test_access_entries_grant_pairs_by_user_or_group(tmp_path: Path) -> None:
    access = [
        {"users": [1000], "tenants": ["prod"], "classes": ["inference"]},
        {"groups": [4242], "tenants": ["*"], "classes": ["training"]},
    ]
    d = daemon(tmp_path, {"jobs": {"access": access}})
    d.start(ALICE, "a", tenant="prod", **{"class": "inference"})
    e = refused_start(d, ALICE, "b", tenant="prod", **{"class": "training"})
    assert isinstance(e, Forbidden), "the pair, not each on its own"
    member = BOB.__class__(pid=BOB.pid, uid=BOB.uid, gid=BOB.gid, groups=frozenset({4242}))
    d.start(member, "c", tenant="prod", **{"class": "training"})
    assert d.ask(member, "g", tenant="prod", **{"class": "training"})["status"] == "granted"
    e = d.refused(BOB, "POST", "/v1/gpus/requests", {"name": "h", "class": "training"})
    assert isinstance(e, Forbidden)


# --- 7: the removal race --------------------------------------------------------------------


def test_a_stale_removal_leaves_a_same_named_successor_alone(d: Daemon) -> None:
    gpu_job(d, ALICE, "train")
    first = d.agent.rec.jobs._jobs["train"]  # what the loop's reap looked at, before ...
    d.exit("train")
    d.call(ALICE, "DELETE", "/v1/jobs", {"name": "train", "exit_status": 0})  # ... finish won
    shutil.rmtree(d.root / "nodeagent.slice" / "train")
    gpu_job(d, ALICE, "train")  # a successor of the same name, with GPUs
    d.exit("train")  # its command has exited; its exec has not said so yet
    ended: list[str] = []
    inner = d.agent.rec.jobs.on_end

    def on_end(job: Job) -> None:
        ended.append(job.name)
        inner(job)

    d.agent.rec.jobs.on_end = on_end
    d.agent.rec.jobs._remove_if_empty(first, None)  # the loop's stale removal of the first
    assert d.jobs() == ["train"], "the successor is still known"
    assert d.holds() == [("train", "job")], "and keeps its GPUs"
    assert ended == []
    d.call(ALICE, "DELETE", "/v1/jobs", {"name": "train", "exit_status": 0})
    assert (d.jobs(), d.holds(), ended) == ([], [], ["train"])


# --- 8: quotas and the cost of the queue ----------------------------------------------------


def test_each_uid_may_run_so_many_jobs_and_wait_for_so_many_gpus(tmp_path: Path) -> None:
    d = daemon(tmp_path, {"jobs": {"max_per_user": 2}, "gpu": {"max_waiting_per_user": 2}})
    d.start(ALICE, "a1")
    d.start(ALICE, "a2")
    e = d.refused(ALICE, "POST", "/v1/jobs", {"name": "a3", "pid": d.child(ALICE)})
    assert isinstance(e, Conflict) and "jobs.max_per_user" in str(e)
    d.start(BOB, "b1")
    d.start(ROOT, "r1")
    d.start(ROOT, "r2")
    d.start(ROOT, "r3")  # root has no cap
    d.ask(BOB, "all", 2)
    assert [d.ask(ALICE, f"w{i}")["status"] for i in range(2)] == ["waiting", "waiting"]
    e = d.refused(ALICE, "POST", "/v1/gpus/requests", {"name": "w2"})
    assert isinstance(e, Conflict) and "gpu.max_waiting_per_user" in str(e)
    assert d.ask(BOB, "bw")["status"] == "waiting"


def test_an_ask_does_not_place_the_whole_queue_again(d: Daemon, monkeypatch: Any) -> None:
    d.ask(ROOT, "all", 2)
    for i in range(50):
        assert d.ask(ROOT, f"w{i}")["status"] == "waiting"
    calls = []

    def counted(request: GpuRequest, node: NodeGpus, held: Holdings) -> Placement | Refusal:
        calls.append(1)
        return place(request, node, held)

    monkeypatch.setattr(ledger_module, "place", counted)
    assert d.ask(ROOT, "one-more")["status"] == "waiting"
    assert len(calls) <= 1, f"{len(calls)} placements for one ask"
    d.agent.tick()  # nothing changed: the queue is not served again
    assert len(calls) <= 1
    d.call(ROOT, "DELETE", "/v1/gpus/requests", {"id": d.ask(ROOT, "probe")["id"]})
    calls.clear()
    granted = d.agent.rec.gpus.ledger._granted.items()
    unclaimed = next(r for r, a in granted if a.hold and a.hold.owner == "all")
    d.call(ROOT, "DELETE", "/v1/gpus/requests", {"id": unclaimed})  # two GPUs free up
    d.agent.tick()
    assert [h for h in d.holds() if h[1] == "request"] == [("w0", "request"), ("w1", "request")]
    # one pass, each shape placed once per grant: w0 and w1 granted, w2 refused; then the
    # GPUs kept for w2, the head (one placement: no hold has an expected end), and w3's
    # shape placed once around them
    assert len(calls) <= 5, calls


# --- issue 34 item 9: whose deadline --------------------------------------------------------


def test_a_members_deadline_is_refused_where_its_class_takes_none(d: Daemon) -> None:
    """`exec --deadline +1m --work <large>` by any member gave its job a floor that the
    protection controller defended by throttling and freezing lower classes. A deadline is
    granted by class (`classes.<c>.declared_deadlines`, refused by default), for the job and
    for the GPU request that orders the queue by it alike; root's is the operator's word."""
    due = {"deadline": time.time() + 60, "work": 1000}
    e = d.refused(ALICE, "POST", "/v1/jobs", {"name": "x", "pid": d.child(ALICE), **due})
    assert isinstance(e, Forbidden), e
    assert str(e).startswith("uid 1000") and "may not declare a deadline in class batch" in str(e)
    e = d.refused(ALICE, "POST", "/v1/gpus/requests", {"name": "x", "count": 1, **due})
    assert isinstance(e, Forbidden) and "classes.batch.declared_deadlines is refused" in str(e)
    assert d.jobs() == [] and d.holds() == []
    d.start(ALICE, "plain")  # without a deadline, as before
    d.start(ROOT, "root", **due)
    assert d.jobs() == ["plain", "root"]


def test_a_class_that_schedules_declared_deadlines_takes_a_members(tmp_path: Path) -> None:
    d = daemon(tmp_path, {"classes": {"batch": {"declared_deadlines": "scheduled"}}})
    due = {"deadline": time.time() + 60, "work": 1000}
    grant = d.ask(ALICE, "x", **due)
    d.start(ALICE, "x", gpu_request=grant["id"], **due)
    (job,) = d.agent.rec.jobs.running()
    assert job.assignment().declared == "uid 1000 through nodeagent exec"
