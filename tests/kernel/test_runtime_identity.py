"""Issue 34 item 1 on the real kernel, with real uids: a local user makes a rootless-style
subtree and names a cgroup in it after root's podman container; the agent must not give it
that container's rule, tenant or class, from root's podman API or, with that API down, from
root's podman store, while root's own container keeps them.

The subtree is delegated to the uid as systemd delegates user@N.service (the cgroup and its
cgroup.procs, cgroup.subtree_control and cgroup.threads chowned to N); everything below it is
made by uid N itself (setpriv), and its spinner moves itself there as uid N. Root's podman API
is a STAND-IN (standin_runtime.py, as in test_runtimes.py) answering for the container id as
root's shop-web; no real podman is started, since the hole is in whom the agent asks. The
agent runs in this process on the test's sandbox as its cgroup root, ticked by the test, in
dry-run: what is checked is whom it asks and what it assigns (`explain`, `allocations`), not
its writes (machine.slice's would go through a systemd this sandbox has not).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import enable_controllers
from helpers import busy, read, spec, wait_for
from standin_runtime import StandInDocker

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cli.inspection import explain_text
from nodeagent.daemon import Agent, open_agent
from nodeagent.report import TickRecord, allocations, explain, identities

UID = 1002
CID = "5a1b" * 16
SOCKET = "/run/nodeagent-h1-podman.sock"  # short: a socket path's limit
SHOP_WEB = {
    "Id": CID,
    "Name": "shop_web_1",
    "ImageName": "registry.example/shop/web:3",
    "Config": {"Labels": {"app": "shop-web"}},
}
RULES = [
    {"name": "shop-web", "match": {"container_name": "shop_web*"}, "tenant": "prod",
     "class": "inference"},
    {"name": "shop-image", "match": {"image": "registry.example/shop/*"}, "tenant": "prod",
     "class": "inference"},
    {"name": "shop-path", "match": {"path": f"*libpod-{CID}.scope"}, "tenant": "prod",
     "class": "inference"},
    {"name": "users", "match": {"owner": "user-systemd"}, "tenant": "users", "class": "batch"},
]  # fmt: skip
"""Root's shop-web by its name, its image and its cgroup's name; then the users' default."""
TENANTS = {"prod": {"shares": 4}, "users": {"shares": 1}}
DELEGATED = ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads")
"""What systemd chowns to the user for a Delegate=yes unit (the cgroup and these files)."""


def as_user(uid: int, *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    )


def rootless_subtree(root: Path, uid: int) -> Path:
    """user.slice/user-N.slice/user@N.service delegated to `uid`, its manager's init.scope
    made, and below it what the user makes: app.slice/libpod-CID.scope. Returns the leaf."""
    manager = root / f"user.slice/user-{uid}.slice/user@{uid}.service"
    manager.mkdir(parents=True)
    for cgroup in (root / "user.slice", manager.parent, manager):
        enable_controllers(cgroup)
    for name in DELEGATED:
        os.chown(manager / name, uid, uid)
    (manager / "init.scope").mkdir()
    os.chown(manager / "init.scope", uid, uid)
    leaf = manager / f"app.slice/libpod-{CID}.scope"
    made = as_user(uid, "sh", "-c", 'mkdir "$0" && echo +cpu +memory > "$1"', str(leaf.parent),
                   str(leaf.parent / "cgroup.subtree_control"))  # fmt: skip
    assert made.wait(timeout=30) == 0, "the user could not make its own slice"
    assert as_user(uid, "mkdir", str(leaf)).wait(timeout=30) == 0
    assert leaf.stat().st_uid == uid, "the user made it"
    return leaf


def users_spinner(leaf: Path, uid: int) -> subprocess.Popen[bytes]:
    """A spinner of `uid`, started in its manager's init.scope (where systemd --user runs),
    that moves itself into `leaf` as the user: allowed only by the delegation."""
    start = next(p for p in leaf.parents if p.name == f"user@{uid}.service") / "init.scope"
    enter = 'echo $$ > "$0/cgroup.procs" && exec sh -c "while :; do :; done"'
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sh", "-c", enter]
    p = subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(start),
                          *argv, str(leaf)])  # fmt: skip
    inside = wait_for(lambda: str(p.pid) in read(leaf, "cgroup.procs").split(), 30)
    assert inside, f"the user's spinner {p.pid} did not move itself into {leaf} in 30 s"
    owner = Path(f"/proc/{p.pid}").stat().st_uid
    assert owner == uid, f"the spinner runs as {owner}, not {uid}"
    return p


@pytest.fixture
def root_podman() -> Iterator[StandInDocker]:
    server = StandInDocker(SOCKET)
    server.answers[CID] = SHOP_WEB
    yield server
    server.close()


def open_on(root: Path, tmp_path: Path, podman: str, storage: str | None) -> Agent:
    runtimes = {"docker": None, "containerd": None, "crio": None, "podman": podman,
                "podman_storage": storage, "timeout": 1.0}  # fmt: skip
    policy = spec("managed", tmp_path, agent={"runtimes": runtimes}, tenants=TENANTS, rules=RULES)
    agent = open_agent(policy, CgroupTree(str(root)), dry_run=True)  # no systemd to write through
    agent.prepare()
    return agent


def both_claimed(agent: Agent, paths: tuple[str, str]) -> TickRecord:
    """Ticks until both cgroups are claimed and root's container has its runtime's answer."""
    last: list[TickRecord] = []

    def done() -> bool:
        last[:] = [agent.tick()]
        found = {i.path: i for i in identities(last[0])}
        return all(p in last[0].assignments for p in paths) and found[paths[0]].meta is not None

    found = wait_for(done, 120, step=0.5)
    assert found, f"not both of {paths} claimed, root's container described, in 120 s of ticks"
    return last[0]


def shown(record: TickRecord, path: str) -> dict[str, Any]:
    """What `nodeagent explain` says of `path`, and its row in `allocations`."""
    identity = next(i for i in identities(record) if i.path == path)
    said = explain(record, identity)
    print(f"\n$ nodeagent explain {path}\n{explain_text(said)}")
    (row,) = [r for r in allocations(record)["allocations"] if r["cgroup"] == path]
    return {**said, "row": row}


def check(record: TickRecord, rootful: str, users: str) -> None:
    mine, theirs = shown(record, rootful), shown(record, users)
    assert (mine["rule"], mine["tenant"], mine["class"], mine["container_name"]) == (
        "shop-web", "prod", "inference", "shop_web_1"), mine  # fmt: skip
    assert (theirs["rule"], theirs["tenant"], theirs["class"]) == ("users", "users", "batch"), (
        f"user {UID}'s look-alike took {theirs['rule']}/{theirs['tenant']}/{theirs['class']}"
        f" (runtime says {theirs['container_name']})"
    )
    assert theirs["container_name"] is None and theirs["image"] is None, theirs
    assert (theirs["row"]["rule"], theirs["row"]["class"]) == ("users", "batch"), theirs["row"]


def test_a_users_look_alike_of_a_rootful_podman_container_takes_nothing_of_its_identity(
    cgroup_sandbox: Path, tmp_path: Path, root_podman: StandInDocker,
    procs: list[subprocess.Popen[bytes]],
) -> None:  # fmt: skip
    root = cgroup_sandbox
    rootful = root / f"machine.slice/libpod-{CID}.scope"
    rootful.mkdir(parents=True)
    enable_controllers(rootful.parent)
    procs.append(busy(rootful))
    leaf = rootless_subtree(root, UID)
    procs.append(users_spinner(leaf, UID))
    paths = (str(rootful.relative_to(root)), str(leaf.relative_to(root)))

    agent = open_on(root, tmp_path, root_podman.path, None)
    try:
        check(both_claimed(agent, paths), *paths)
    finally:
        agent.rec.runtimes.close()
    asked = [r for r in root_podman.requests if CID in r]
    assert len(asked) == 1, f"root's podman asked about the id more than once: {asked}"

    # root's podman API down (no socket): its store names the id as shop-web; still not theirs
    store = tmp_path / "storage/overlay-containers"
    store.mkdir(parents=True)
    entry = {"id": CID, "names": ["shop_web_1"],
             "metadata": json.dumps({"image-name": "registry.example/shop/web:3"})}  # fmt: skip
    (store / "containers.json").write_text(json.dumps([entry]))
    agent = open_on(root, tmp_path / "down", "/run/nodeagent-h1-absent.sock", str(store.parent))
    try:
        check(both_claimed(agent, paths), *paths)
    finally:
        agent.rec.runtimes.close()
