"""deploy/rollout, the staged rollout (issue 35): one DaemonSet and one policy per pool of
nodes and per pool a canary, rendered by the real `kubectl kustomize`. No scheduler runs
here: `places` is a stand-in for its node selection (nodeSelector and required node
affinity, with the operators the DaemonSets use, as the API documents them), enough to
prove that every node runs exactly one agent.
"""

from __future__ import annotations

import copy
import itertools
import re
from typing import Any

import pytest
from kube_schemas import ROOT, kustomize, problems
from test_kube_manifests import Pod, one, without

from nodeagent.policyfile.load import check_text, digest
from nodeagent.policyfile.model import AgentMode

POOL = "nodeagent.io/pool"
CANARY = "nodeagent.io/canary"
DAEMONSETS = {
    # the DaemonSet: its policy's ConfigMap, and whether its pods have the NVIDIA runtime
    "nodeagent-general": ("nodeagent-policy-general", False),
    "nodeagent-general-canary": ("nodeagent-policy-general-canary", False),
    "nodeagent-gpu": ("nodeagent-policy-gpu", True),
    "nodeagent-gpu-canary": ("nodeagent-policy-gpu-canary", True),
}


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return kustomize("deploy/rollout")


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return kustomize("deploy/kubernetes")


def daemonsets(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "DaemonSet"}


def test_every_object_is_valid_and_named_once(rendered: list[dict[str, Any]]) -> None:
    for doc in rendered:
        assert problems(doc) == [], f"{doc['kind']}/{doc['metadata']['name']}"
    ids = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in rendered]
    assert len(ids) == len(set(ids))
    assert set(daemonsets(rendered)) == set(DAEMONSETS)


def test_the_pools_share_everything_but_the_agent_and_its_policy(
    rendered: list[dict[str, Any]], base: list[dict[str, Any]]
) -> None:
    """The Namespace, RBAC, Service and PrometheusRule are ../kubernetes's unchanged; the
    ServiceMonitor only adds the pool and canary labels; ../kubernetes's DaemonSet and
    ConfigMap are not there (an agent of its own beside a pool's would be a second agent
    on the node)."""
    shared = {(d["kind"], d["metadata"]["name"]): d for d in base}
    del shared[("DaemonSet", "nodeagent")], shared[("ConfigMap", "nodeagent-policy")]
    monitor = copy.deepcopy(one(rendered, "ServiceMonitor"))
    (endpoint,) = monitor["spec"]["endpoints"]
    added = endpoint["relabelings"][len(shared[("ServiceMonitor", "nodeagent")]["spec"]
                                        ["endpoints"][0]["relabelings"]):]  # fmt: skip
    assert {r["targetLabel"]: r["sourceLabels"] for r in added} == {
        "pool": [meta_label(POOL)], "canary": [meta_label(CANARY)]
    }  # fmt: skip
    del endpoint["relabelings"][-len(added) :]
    assert monitor == shared[("ServiceMonitor", "nodeagent")]
    others = {
        (d["kind"], d["metadata"]["name"]): d
        for d in rendered
        if d["kind"] not in ("DaemonSet", "ConfigMap", "ServiceMonitor")
    }
    del shared[("ServiceMonitor", "nodeagent")]
    assert others == shared


def meta_label(key: str) -> str:
    """The meta label Prometheus's Kubernetes discovery gives a pod's label `key`."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def test_each_pool_runs_the_agent_of_kubernetes_with_its_own_policy(
    rendered: list[dict[str, Any]], base: list[dict[str, Any]]
) -> None:
    """Each DaemonSet is ../kubernetes's with its name, its pool's labels, its nodes, its
    policy's ConfigMap and (the gpu pools) the NVIDIA runtime, nothing else; each
    ConfigMap's policy is valid, reloads on change and, as shipped, says what
    ../kubernetes's does (a rollout starts from there)."""
    shipped = one(base, "ConfigMap", "nodeagent-policy")["data"]["policy.yaml"]
    base_digest = digest(check_text(shipped, "deploy/kubernetes").spec)
    unchanged = one(base, "DaemonSet")
    for name, daemonset in daemonsets(rendered).items():
        configmap, gpu = DAEMONSETS[name]
        pod = Pod(daemonset)
        assert pod.volumes["policy"]["configMap"]["name"] == configmap
        policy = check_text(one(rendered, "ConfigMap", configmap)["data"]["policy.yaml"], name).spec
        assert policy.agent.mode is AgentMode.KUBERNETES and policy.agent.reload_on_change
        assert digest(policy) == base_digest, f"{configmap} is not deploy/kubernetes's policy"
        assert ("runtimeClassName" in pod.spec) is gpu
        pool = name.removeprefix("nodeagent-").removesuffix("-canary")
        labels = {POOL: pool, CANARY: str(name.endswith("-canary")).lower()}
        assert daemonset["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/name": "nodeagent", **labels
        }  # fmt: skip
        assert daemonset["spec"]["template"]["metadata"]["labels"].items() >= labels.items()
        same = without(daemonset)
        same["metadata"] = unchanged["metadata"]
        same["spec"]["selector"] = unchanged["spec"]["selector"]
        same["spec"]["template"]["metadata"] = unchanged["spec"]["template"]["metadata"]
        spec = same["spec"]["template"]["spec"]
        del spec["affinity"]
        spec["volumes"]["policy"]["configMap"]["name"] = "nodeagent-policy"
        assert same == without(unchanged), name


def matches(term: dict[str, Any], labels: dict[str, str]) -> bool:
    """One nodeSelectorTerm: all its expressions hold (NotIn and DoesNotExist hold for a
    node without the label, as the API documents them)."""
    ops = {
        "In": lambda e: labels.get(e["key"]) in e["values"],
        "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
        "Exists": lambda e: e["key"] in labels,
        "DoesNotExist": lambda e: e["key"] not in labels,
    }
    return all(ops[e["operator"]](e) for e in term.get("matchExpressions", []))


def places(daemonset: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether the DaemonSet runs a pod on a node with `labels` (stand-in for the
    scheduler: nodeSelector, then any one of the required affinity's terms)."""
    spec = daemonset["spec"]["template"]["spec"]
    if not spec.get("nodeSelector", {}).items() <= labels.items():
        return False
    required = spec.get("affinity", {}).get("nodeAffinity", {})
    terms = required.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return any(matches(t, labels) for t in terms.get("nodeSelectorTerms", [{}]))


NODE = {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}


@pytest.mark.parametrize(
    ("pool", "canary"),
    list(itertools.product([None, "general", "gpu", "other", ""], [None, "true", "false", ""])),
)
def test_every_node_runs_exactly_one_agent(
    rendered: list[dict[str, Any]], pool: str | None, canary: str | None
) -> None:
    """The selectors are disjoint and cover every node, labelled or not: the gpu pool's
    nodes run the gpu DaemonSets, every other node the general ones (a node with no pool
    label, or one no DaemonSet names, is general), and only nodeagent.io/canary=true makes
    a canary."""
    labels = dict(NODE)
    if pool is not None:
        labels[POOL] = pool
    if canary is not None:
        labels[CANARY] = canary
    running = [n for n, d in daemonsets(rendered).items() if places(d, labels)]
    expected = "nodeagent-" + ("gpu" if pool == "gpu" else "general")
    assert running == [expected + ("-canary" if canary == "true" else "")]


def test_the_base_node_constraints_stay(rendered: list[dict[str, Any]]) -> None:
    """The image's platform still decides first: an arm64 node runs none."""
    for name, daemonset in daemonsets(rendered).items():
        assert not places(daemonset, {**NODE, "kubernetes.io/arch": "arm64", POOL: "gpu"}), name


def test_no_daemonset_owns_anothers_pods(rendered: list[dict[str, Any]]) -> None:
    """Distinct selectors: each DaemonSet's selector matches its own pods only, while the
    shared Service selects them all (one scrape target per node)."""
    sets = daemonsets(rendered)
    service = one(rendered, "Service")["spec"]["selector"]
    for (a, one_set), (b, other) in itertools.product(sets.items(), repeat=2):
        pods = other["spec"]["template"]["metadata"]["labels"]
        owns = one_set["spec"]["selector"]["matchLabels"].items() <= pods.items()
        assert owns is (a == b), (a, b)
        assert service.items() <= pods.items()


def test_the_docs_give_the_procedure(rendered: list[dict[str, Any]]) -> None:
    """docs/kubernetes.md names the layout, the labels, each policy file and the commands
    and queries of a canary's change, its promotion and its rollback."""
    said = (ROOT / "docs/kubernetes.md").read_text()
    needed = [
        "kubectl apply -k deploy/rollout", f"{POOL}=gpu", f"{CANARY}=true",
        "count by (pool, canary, sha256) (nodeagent_policy_info)",
        "NodeagentConfigReloadFailed", "nodeagent_config_last_reload_successful",
        "kubectl -n nodeagent delete daemonset nodeagent", "maxUnavailable",
        "/var/lib/nodeagent",
    ]  # fmt: skip
    kustomization = (ROOT / "deploy/rollout/kustomization.yaml").read_text()
    needed += re.findall(r"policies/[a-z-]+\.yaml", kustomization)
    assert len(needed) > 9 + 3
    assert [n for n in needed if n not in said] == []
