"""Kubernetes mode on a real kernel with a real containerd (Debian's, its CRI plugin): pods
made through the CRI as the kubelet makes them (tests/kernel/runtimes.py; no kubelet runs
here), under the cgroupfs driver in the VM. Each pod's tenant comes from its namespace, its
class from its annotations; a pod that claims a tenant its namespace may not use is refused
and reported (rule.value_refused), and stays its namespace's. No kubelet socket exists: no
GPU is simulated here, so PodResources is never asked. The rule caps every container,
but kube-system's pod is node-critical (kubernetes.node_critical): never capped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import runtimes as rt
import structlog
from helpers import spec

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent

SLEEP = ("sleep", "3600")


@pytest.fixture
def containerd(cgroupfs_runtimes: rt.Runtimes) -> Iterator[rt.Runtimes]:
    """The run's cgroupfs runtimes (conftest.py, shared with test_runtimes.py), without the
    pods and containers this test made once it is done."""
    try:
        yield cgroupfs_runtimes
    finally:
        cgroupfs_runtimes.remove_pods()
        cgroupfs_runtimes.remove_containers()


def test_cri_pods_tenant_from_namespace_class_from_annotations_and_a_claim_refused(
    containerd: rt.Runtimes, tmp_path: Path, managed: str
) -> None:
    r = containerd
    try:
        train = r.run_pod("research-nlp", "train-0", {"app": "train"},
                          {"nodeagent.io/class": "training"}, {"trainer": SLEEP})  # fmt: skip
        serve = r.run_pod("prod-serving", "serve-0", {"app": "serve"},
                          {"nodeagent.io/class": "inference"}, {"server": SLEEP})  # fmt: skip
        claim = r.run_pod("research-nlp", "sneaky-0", {},
                          {"nodeagent.io/tenant": "prod"}, {"app": SLEEP})  # fmt: skip
        proxy = r.run_pod("kube-system", "kube-proxy-0", {"k8s-app": "kube-proxy"}, {},
                          {"kube-proxy": SLEEP})  # fmt: skip
        policy = spec(
            managed, tmp_path,
            agent={"mode": "kubernetes", "resync_interval": 1,
                   "runtimes": {"containerd": r.paths.containerd, "docker": None,
                                "podman": None, "podman_storage": None, "crio": None,
                                "timeout": 5}},
            kubernetes={"pod_resources_socket": str(tmp_path / "no-kubelet.sock"),
                        "namespaces": {"research-*": {"tenant": "research",
                                                      "classes": ["training"]},
                                       "prod-*": {"tenant": "prod", "allow": ["research"],
                                                  "classes": ["inference"]}}},
            tenants={"research": {"shares": 2}, "prod": {"shares": 1}, "other": {"shares": 1}},
            rules=[{"name": "pods", "match": {"kind": "container", "path": "kubepods*"},
                    "tenant": "other", "tenant_from": {"kubernetes": True},
                    "class_from": {"kubernetes": True}, "limits": {"cpu_max": 0.5}}],
        )  # fmt: skip

        def cgroup(pod: rt.Pod, name: str) -> str:
            return str(pod.containers[name].cgroup.relative_to(r.sandbox_root))

        agent = open_agent(policy, CgroupTree(str(r.sandbox_root)))
        agent.prepare()
        with structlog.testing.capture_logs() as logs:
            record = agent.tick()
            for _ in range(5):  # the runtime's answers may take a tick or two under TCG
                paths = {
                    str(p.containers[n].cgroup.relative_to(r.sandbox_root))
                    for p, n in ((train, "trainer"), (serve, "server"), (claim, "app"))
                }
                known = {p for p, a in record.assignments.items() if a.tenant != "other"}
                if paths <= known and cgroup(proxy, "kube-proxy") in record.assignments:
                    break
                record = agent.tick()

        def owner(pod: rt.Pod, name: str) -> tuple[str, str, tuple[str, ...]]:
            a = record.assignments[cgroup(pod, name)]
            return a.tenant, str(a.workload_class), a.refused

        assert owner(train, "trainer") == ("research", "training", ())
        assert owner(serve, "server") == ("prod", "inference", ())
        refusal = (
            "pod research-nlp/sneaky-0 claims tenant 'prod', which namespace research-nlp may"
            " not use (it may: research); refused"
        )
        assert owner(claim, "app") == ("research", "batch", (refusal,))
        # said once per cgroup: the container's, and its pod's sandbox (pause) container's when
        # the rule claims that too; never twice for one cgroup
        said = [(e["cgroup"], e["refused"]) for e in logs if e["event"] == "rule.value_refused"]
        app = str(claim.containers["app"].cgroup.relative_to(r.sandbox_root))
        assert (app, refusal) in said, said
        assert len(said) == len(set(said)) and {x for _, x in said} == {refusal}, said
        # what keeps the node running is never capped, whatever the rule says (issue 35)
        kept = record.assignments[cgroup(proxy, "kube-proxy")]
        assert (kept.node_critical or "").startswith(
            "node-critical: pod kube-system/kube-proxy-0 is in namespace kube-system"
        ), kept
        assert (proxy.containers["kube-proxy"].cgroup / "cpu.max").read_text() == "max 100000\n"
        assert (train.containers["trainer"].cgroup / "cpu.max").read_text() == "50000 100000\n"
        assert agent.rec.kube is not None
        agent.rec.kube.close()
    finally:
        r.remove_pods()
