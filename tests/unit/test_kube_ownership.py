"""Beside the kubelet: how the agent may write each cgroup the kubelet makes, under
either cgroup driver. The QoS tiers are the kubelet's (it rewrites them about every
minute) and read-only unless the operator says otherwise; pods and their containers are
written directly under the cgroupfs driver and through their systemd units under the
systemd driver (the executor then asks systemd which unit owns the path, see
test_act_systemd.py)."""

from __future__ import annotations

import pytest

from nodeagent.ownership import WriteMode, parent_identity, write_mode
from nodeagent.policyfile.model import AgentSettings

UID = "3b1e5f2a-9c4d-4e7f-8a6b-0d2c1e9f7a35"
UID_ = UID.replace("-", "_")
CID = "4f1c2a9be7d3" + "0123456789abcdef" * 3 + "0123"
ROOT = "nodeagent.slice"
SYSTEMD_DRIVER = {
    "kubepods.slice": "tier",
    "kubepods.slice/kubepods-burstable.slice": "tier",
    "kubepods.slice/kubepods-besteffort.slice": "tier",
    f"kubepods.slice/kubepods-pod{UID_}.slice": "pod",
    f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice": "pod",
    f"kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope": "container",
    f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
    f"/crio-{CID}.scope": "container",
}
CGROUPFS_DRIVER = {
    "kubepods": "tier",
    "kubepods/burstable": "tier",
    "kubepods/besteffort": "tier",
    f"kubepods/pod{UID}": "pod",
    f"kubepods/burstable/pod{UID}": "pod",
    f"kubepods/pod{UID}/{CID}": "container",
    f"kubepods/besteffort/pod{UID}/crio-{CID}": "container",
}


@pytest.mark.parametrize(
    ("driver", "paths", "written"),
    [("systemd", SYSTEMD_DRIVER, WriteMode.SYSTEMD), ("cgroupfs", CGROUPFS_DRIVER,
                                                      WriteMode.DIRECT)],
)  # fmt: skip
def test_by_default_the_tiers_are_left_to_the_kubelet_and_pods_written_as_their_driver_wants(
    driver: str, paths: dict[str, str], written: WriteMode
) -> None:
    settings = AgentSettings()
    modes = {p: write_mode(parent_identity(p, ROOT), settings) for p in paths}
    assert modes == {
        p: WriteMode.READ_ONLY if what == "tier" else written for p, what in paths.items()
    }, driver


@pytest.mark.parametrize(
    ("paths", "written"),
    [(SYSTEMD_DRIVER, WriteMode.SYSTEMD), (CGROUPFS_DRIVER, WriteMode.DIRECT)],
)
def test_an_operator_may_take_the_tiers_over(paths: dict[str, str], written: WriteMode) -> None:
    settings = AgentSettings.model_validate({"kubelet_levels": "write"})
    tiers = [p for p, what in paths.items() if what == "tier"]
    assert {write_mode(parent_identity(p, ROOT), settings) for p in tiers} == {written}


def test_pod_units_obey_the_systemd_containers_setting() -> None:
    settings = AgentSettings.model_validate({"systemd": {"containers": "read-only"}})
    pods = [p for p, what in SYSTEMD_DRIVER.items() if what != "tier"]
    assert {write_mode(parent_identity(p, ROOT), settings) for p in pods} == {WriteMode.READ_ONLY}
