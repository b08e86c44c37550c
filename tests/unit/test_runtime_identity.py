"""Issue 34 item 1: a user's cgroups never take a rootful container's identity.

User N makes any cgroup below user@N.service (Delegate=yes), named as it likes: a
`libpod-<id>.scope` there named after root's container (ids are world-readable in
/proc/*/cgroup) must not be asked of root's podman (its API, or its store when the API is
down), nor of any other system runtime; with `podman_per_user` it is asked of user N's own
podman alone; and whatever is said of it, or its cgroup's name, matches only rules that name
`owner: user-systemd`. Root's podman is played by the labelled STAND-IN (standin_runtime.py),
as in test_runtimes.py. The real-kernel counterpart, with real uids, is
tests/kernel/test_runtime_identity.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from nodeagent.discovery.layouts import classify
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.policy.classify import assign
from nodeagent.policyfile.model import PolicySpec, RuntimeSettings
from nodeagent.runtimes.metadata import RuntimeMetadata
from nodeagent.runtimes.podman import PodmanAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel"))
from standin_runtime import StandInDocker

TIMEOUT = 0.5
CID = "5a1b" * 16
ROOTFUL = f"machine.slice/libpod-{CID}.scope"
USER = f"user.slice/user-1002.slice/user@1002.service/app.slice/libpod-{CID}.scope"
SHOP_WEB = {
    "Id": CID,
    "Name": "shop_web_1",
    "ImageName": "registry.example/shop/web:3",
    "Config": {"Labels": {"app": "shop-web"}},
}


def identity(path: str) -> WorkloadIdentity:
    found = classify(path, "nodeagent.slice")
    assert found is not None, path
    return found


def policy(*rules: Mapping[str, object]) -> PolicySpec:
    return PolicySpec.model_validate(
        {"version": 1, "tenants": {"prod": {"shares": 4}, "users": {"shares": 1}},
         "rules": list(rules)}
    )  # fmt: skip


SHOP_RULES = (
    {"name": "shop-web", "match": {"container_name": "shop_web*"}, "tenant": "prod",
     "class": "inference"},
    {"name": "by-label", "match": {"labels": {"app": "shop-web"}}, "tenant": "prod",
     "class": "inference"},
    {"name": "by-image", "match": {"image": "registry.example/shop/*"}, "tenant": "prod",
     "class": "inference"},
    {"name": "by-path", "match": {"path": f"*/libpod-{CID}.scope"}, "tenant": "prod",
     "class": "inference"},
)  # fmt: skip
"""Rules written for root's shop-web: by its name, label, image, and its cgroup's name."""


@pytest.fixture
def root_podman(tmp_path: Path) -> Iterator[StandInDocker]:
    """Root's podman API: a STAND-IN that answers for CID as root's shop-web container."""
    server = StandInDocker(str(tmp_path / "podman.sock"))
    server.answers[CID] = SHOP_WEB
    yield server
    server.close()


def test_the_layout_says_whose_subtree_a_container_is_in() -> None:
    from nodeagent.discovery.layouts import delegated_uid

    user, rootful = identity(USER), identity(ROOTFUL)
    assert (user.runtime, user.owner, user.container_id) == (
        Runtime.PODMAN, Owner.USER_SYSTEMD, CID)  # fmt: skip
    assert (rootful.owner, delegated_uid(ROOTFUL)) == (Owner.SYSTEMD, None)
    assert delegated_uid(USER) == 1002
    assert delegated_uid("user.slice/user-1002.slice/user@1002.service") == 1002
    assert delegated_uid("user.slice/user-1002.slice/user@1003.service/a.slice") is None
    assert delegated_uid("user.slice/user-1002.slice/session-4.scope") is None


def test_a_users_look_alike_is_not_asked_of_roots_podman(root_podman: StandInDocker) -> None:
    meta = RuntimeMetadata({"podman": PodmanAdapter(root_podman.path, TIMEOUT, None)})
    rootful, user = meta.attach([identity(ROOTFUL), identity(USER)])
    assert rootful.meta is not None and rootful.meta.name == "shop_web_1"
    assert user.meta is None, f"root's podman described user 1002's cgroup: {user.meta}"
    assert user.meta_problem is not None and "user 1002" in user.meta_problem
    assert len(root_podman.requests) == 1, root_podman.requests
    assert meta.retry_at(user) is None, "nothing will come: not to be retried"
    again = meta.attach([identity(ROOTFUL), identity(USER)])
    assert again[1] is user, "the same object each tick while nothing changed"
    found = assign([rootful, user], policy(*SHOP_RULES))
    assert (found[ROOTFUL].rule, found[ROOTFUL].tenant, found[ROOTFUL].workload_class) == (
        "shop-web", "prod", "inference")  # fmt: skip
    assert USER not in found, f"user 1002's cgroup took {found.get(USER)}"


def test_nor_of_roots_podman_store_when_its_api_is_down(tmp_path: Path) -> None:
    store = tmp_path / "storage" / "overlay-containers"
    store.mkdir(parents=True)
    entry = {"id": CID, "names": ["shop_web_1"],
             "metadata": json.dumps({"image-name": "registry.example/shop/web:3"})}  # fmt: skip
    (store / "containers.json").write_text(json.dumps([entry]))
    absent = str(tmp_path / "podman.sock")
    meta = RuntimeMetadata({"podman": PodmanAdapter(absent, TIMEOUT, str(tmp_path / "storage"))})
    rootful, user = meta.attach([identity(ROOTFUL), identity(USER)])
    assert rootful.meta is not None and rootful.meta.name == "shop_web_1"
    assert user.meta is None, f"root's podman store described user 1002's cgroup: {user.meta}"
    found = assign([rootful, user], policy(*SHOP_RULES))
    assert found[ROOTFUL].rule == "shop-web" and USER not in found


def test_docker_and_containerd_ids_below_a_user_are_asked_of_no_system_runtime(
    root_podman: StandInDocker,
) -> None:
    """No layout makes a docker or CRI container of a user's cgroup; should one come (a
    layout added later), the user's subtree still decides: root's runtimes are not asked."""
    for name in (f"docker-{CID}.scope", f"cri-containerd-{CID}.scope", CID):
        assert classify(f"user.slice/user-7.slice/user@7.service/a.slice/{name}", "n") is None
    adapters = {r: PodmanAdapter(root_podman.path, TIMEOUT, None) for r in ("docker", "containerd")}
    meta = RuntimeMetadata(adapters)
    made = [
        WorkloadIdentity(
            USER.replace("libpod", prefix), Kind.CONTAINER, runtime, Owner.USER_SYSTEMD,
            CID[:12], container_id=CID,
        )
        for prefix, runtime in (("docker", Runtime.DOCKER), ("cri-containerd", Runtime.CONTAINERD))
    ]  # fmt: skip
    assert all(w.meta is None for w in meta.attach(made))
    assert root_podman.requests == []


def test_per_user_podman_asks_that_users_socket_and_its_word_maps_only_to_user_rules(
    root_podman: StandInDocker, tmp_path: Path
) -> None:
    """With `podman_per_user`, user 1002's own podman (a second stand-in, at the socket
    USER_PODMAN names for it) is asked; it may say anything, root's container's name
    included, and still takes only what a rule for owner user-systemd gives."""
    from nodeagent.runtimes.metadata import USER_PODMAN

    settings = RuntimeSettings.model_validate({"podman": root_podman.path, "podman_storage": None,
                                               "docker": None, "containerd": None, "crio": None,
                                               "podman_per_user": True})  # fmt: skip
    meta = RuntimeMetadata.from_settings(settings)
    assert meta.user_podman is not None
    made = meta.user_podman(1002)
    assert made.socket == USER_PODMAN.format(uid=1002) == "/run/user/1002/podman/podman.sock"
    users = StandInDocker(str(tmp_path / "user-podman.sock"))
    try:
        users.answers[CID] = SHOP_WEB
        meta.user_podman = lambda uid: PodmanAdapter(users.path, TIMEOUT, None)
        rootful, user = meta.attach([identity(ROOTFUL), identity(USER)])
        assert user.meta is not None and user.meta.name == "shop_web_1"
        assert len(root_podman.requests) == 1 and len(users.requests) == 1
        assert set(meta.status()) == {"podman", "podman@1002"}
        found = assign([rootful, user], policy(*SHOP_RULES))
        assert found[ROOTFUL].rule == "shop-web" and USER not in found
        for_users = {"name": "user-podman", "match": {"owner": "user-systemd", "runtime": "podman"},
                     "tenant": "users", "class": "batch"}  # fmt: skip
        found = assign([rootful, user], policy(*SHOP_RULES, for_users))
        assert (found[USER].rule, found[USER].tenant) == ("user-podman", "users")
    finally:
        users.close()
        meta.close()


def test_a_user_service_named_like_a_system_one_takes_only_user_rules() -> None:
    service = identity("user.slice/user-1002.slice/user@1002.service/app.slice/shop-web.service")
    system = identity("system.slice/shop-web.service")
    rules = (
        {"name": "shop", "match": {"name": "shop-web.service"}, "tenant": "prod",
         "class": "inference"},
        {"name": "users", "match": {"owner": "user-systemd"}, "tenant": "users", "class": "batch"},
    )  # fmt: skip
    found = assign([service, system], policy(*rules))
    assert (found[system.path].rule, found[service.path].rule) == ("shop", "users")
