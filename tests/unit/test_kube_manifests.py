"""deploy/kubernetes: rendered by the real `kubectl kustomize`, every object valid against
its schema, least-privilege RBAC, and the DaemonSet's mounts cross-checked with the paths
the agent opens under the policy the ConfigMap carries.
"""

from __future__ import annotations

import copy
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_schemas import ROOT, kustomize, problems

from nodeagent.metrics.families import WORKLOAD
from nodeagent.policyfile.listen import parse_listen
from nodeagent.policyfile.load import check_text
from nodeagent.policyfile.model import AgentMode, PolicySpec
from nodeagent.sdbus import SYSTEM_BUS_ADDRESS

CRI_SOCKET = "/run/containerd/containerd.sock"
"""containerd's CRI socket, as the kubelet is configured for it on most nodes."""
LAYOUTS = [
    "deploy/kubernetes", "deploy/node-resource-topology", "deploy/k3s", "deploy/cri-o",
    "deploy/nvidia-runtime", "deploy/nvidia-host-driver", "deploy/rollout",
]  # fmt: skip
"""The DaemonSet and its overlays: ../kubernetes plus one thing each (deploy/rollout: one
DaemonSet per pool, tests/unit/test_kube_rollout.py)."""


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return kustomize("deploy/kubernetes")


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def test_kustomize_renders_every_object_the_issue_lists(rendered: list[dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in rendered)
    assert kinds == [
        "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Namespace",
        "PrometheusRule", "Service", "ServiceAccount", "ServiceMonitor",
    ]  # fmt: skip
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] not in (
        "Namespace", "ClusterRole", "ClusterRoleBinding")} == {"nodeagent"}  # fmt: skip


@pytest.mark.parametrize("directory", LAYOUTS)
def test_every_object_is_valid_against_its_schema(directory: str) -> None:
    for doc in kustomize(directory):
        assert problems(doc) == [], f"{doc['kind']}/{doc['metadata']['name']}"


def test_the_schemas_catch_a_wrong_field(rendered: list[dict[str, Any]]) -> None:
    """Not a vacuous check: a typo in a built-in kind and in a custom resource fails."""
    daemonset = copy.deepcopy(one(rendered, "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    assert problems(daemonset)
    monitor = copy.deepcopy(one(rendered, "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    assert problems(monitor)
    monitor["spec"]["endpoints"][0] = {"port": 9464}
    assert problems(monitor)


CALLS = {
    # the API watch's informers list, then watch from the list's resourceVersion
    "list_pod_for_all_namespaces": ("", "pods", ("list", "watch")),
    "list_namespace": ("", "namespaces", ("list", "watch")),
    # publishing a NodeResourceTopology (nodeagent/kube/publish.py)
    "read_node": ("", "nodes", ("get",)),
    "get_cluster_custom_object": ("topology.node.k8s.io", "noderesourcetopologies", ("get",)),
    "create_cluster_custom_object": (
        "topology.node.k8s.io", "noderesourcetopologies", ("create",)
    ),
    "replace_cluster_custom_object": (
        "topology.node.k8s.io", "noderesourcetopologies", ("update",)
    ),
}  # fmt: skip
"""Each Kubernetes API method the agent calls: the group, resource and verbs it needs."""


def api_calls() -> dict[str, set[str]]:
    """The Kubernetes client's API methods named anywhere in nodeagent/, by source file."""
    from kubernetes import client

    methods = {
        name
        for api in (client.CoreV1Api, client.CustomObjectsApi, client.EventsV1Api)
        for name in dir(api)
        if re.match(r"(list|read|get|create|replace|patch|delete|connect)_", name)
        and not name.endswith("_with_http_info")
    }
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "nodeagent").rglob("*.py")):
        named = set(re.findall(r"\.([a-z_]+)\b", path.read_text())) & methods
        if named:
            out[path.name] = named
    return out


def grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def needs(methods: set[str]) -> set[tuple[str, str, str]]:
    unknown = methods - CALLS.keys()
    assert not unknown, f"{unknown}: add each to CALLS, and to the ClusterRole what it needs"
    return {(g, r, verb) for m in methods for g, r, verbs in [CALLS[m]] for verb in verbs}


def test_the_cluster_roles_grant_exactly_the_verbs_the_code_uses(
    rendered: list[dict[str, Any]],
) -> None:
    """Both ways: a verb granted that no call needs is a privilege for nothing (the Events
    create and patch once granted here), a call not granted fails on a real cluster."""
    calls = api_calls()
    assert set(calls) == {"apiwatch.py", "publish.py"}, calls
    watch = needs(set().union(*(m for f, m in calls.items() if f != "publish.py")))
    assert grants(one(rendered, "ClusterRole")) == watch == {
        ("", "pods", "list"), ("", "pods", "watch"),
        ("", "namespaces", "list"), ("", "namespaces", "watch"),
    }  # fmt: skip
    topology = kustomize("deploy/node-resource-topology")
    published = one(topology, "ClusterRole", "nodeagent-node-resource-topology")
    assert grants(published) == needs(calls["publish.py"])
    binding = one(rendered, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "nodeagent", "namespace": "nodeagent"}
    ]
    daemonset = one(rendered, "DaemonSet")
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == "nodeagent"


def test_publishing_topology_adds_only_its_own_objects() -> None:
    docs = kustomize("deploy/node-resource-topology")
    extra = [d for d in docs if d["metadata"]["name"] == "nodeagent-node-resource-topology"]
    assert {d["kind"] for d in extra} == {"ClusterRole", "ClusterRoleBinding"}
    base = {(d["kind"], d["metadata"]["name"]) for d in kustomize("deploy/kubernetes")}
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} - base == {
        (d["kind"], d["metadata"]["name"]) for d in extra
    }


def test_the_prometheus_rule_is_the_alert_rules_file(rendered: list[dict[str, Any]]) -> None:
    rules_file = yaml.safe_load((ROOT / "config/prometheus/nodeagent-alerts.yaml").read_text())
    assert one(rendered, "PrometheusRule")["spec"]["groups"] == rules_file["groups"]
    alerts = {r["alert"] for g in rules_file["groups"] for r in g["rules"]}
    # what the issue asks for: down or stale, failed writes, deadline misses, GPU violations
    assert {
        "NodeagentDown", "NodeagentTickStale", "NodeagentCgroupWritesFailing",
        "NodeagentDeadlineMissed", "NodeagentGpuViolation",
    } <= alerts  # fmt: skip
    # the rules ask for job="nodeagent": the ServiceMonitor's job label must be that
    service = one(rendered, "Service")
    monitor = one(rendered, "ServiceMonitor")
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "nodeagent"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()


def test_the_service_monitor_keeps_the_workloads_namespace_and_pod(
    rendered: list[dict[str, Any]],
) -> None:
    """The agent's series name the pods it manages in `namespace` and `pod`, as
    kube-state-metrics does; without honorLabels Prometheus renames them exported_namespace
    and exported_pod (the target's own labels win), and every join on them is wrong."""
    (endpoint,) = one(rendered, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True
    text = (ROOT / "docs/metrics.md").read_text()
    said = text[text.index("Each workload's series carry") :].split("*W*", 1)[0]
    assert [label for label in WORKLOAD if f"`{label}`" not in said] == []


def test_metrics_want_the_token_the_service_monitor_sends(
    rendered: list[dict[str, Any]], pod: Pod, policy: PolicySpec
) -> None:
    """/metrics asks for a bearer token (issue 35: metrics behind a token), the file the
    pod mounts from the Secret nodeagent-metrics-token, and the ServiceMonitor sends that
    Secret's same key; the probes' /healthz stays open."""
    token_file = policy.agent.metrics.bearer_token_file
    assert token_file is not None
    mount = pod.mount_of(token_file)
    assert mount.get("readOnly") is True
    secret = pod.volumes[mount["name"]]["secret"]
    key = posixpath.relpath(token_file, mount["mountPath"])
    assert {"key": "token", "path": key} in secret["items"]
    assert secret["defaultMode"] == 0o400
    (endpoint,) = one(rendered, "ServiceMonitor")["spec"]["endpoints"]
    credentials = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer"
    assert (credentials["name"], credentials["key"]) == (secret["secretName"], "token")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert pod.container[probe]["httpGet"]["path"] == "/healthz"
    # the install says how to make the Secret before the first apply
    said = (ROOT / "docs/kubernetes.md").read_text()
    assert f"create secret generic {secret['secretName']}" in said


class Pod:
    """The DaemonSet's pod spec, read as the kubelet would lay out its container."""

    def __init__(self, daemonset: dict[str, Any]) -> None:
        self.spec = daemonset["spec"]["template"]["spec"]
        (self.container,) = self.spec["containers"]
        self.volumes = {v["name"]: v for v in self.spec["volumes"]}
        self.mounts = self.container["volumeMounts"]

    def arg(self, name: str) -> str:
        args: list[str] = self.container["args"]
        values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
        assert len(values) == 1, f"{name} given {len(values)} times"
        return values[0]

    def mount_of(self, path: str) -> dict[str, Any]:
        inside = [
            m for m in self.mounts
            if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
        ]  # fmt: skip
        assert inside, f"{path} is in no volume of the pod: it would be the image's own file"
        return max(inside, key=lambda m: len(m["mountPath"]))

    def host_path(self, path: str) -> tuple[str, bool]:
        """The host's path that `path` in the container is, and whether it is read-only."""
        mount = self.mount_of(path)
        volume = self.volumes[mount["name"]]
        assert "hostPath" in volume, f"{path} is on volume {mount['name']}, not a host path"
        assert "subPath" not in mount
        rest = posixpath.relpath(path, mount["mountPath"])
        host = posixpath.normpath(posixpath.join(volume["hostPath"]["path"], rest))
        return host, bool(mount.get("readOnly"))


@pytest.fixture(scope="module")
def pod(rendered: list[dict[str, Any]]) -> Pod:
    return Pod(one(rendered, "DaemonSet"))


@pytest.fixture(scope="module")
def policy(rendered: list[dict[str, Any]], pod: Pod) -> PolicySpec:
    config = pod.arg("--config")
    mount = pod.mount_of(config)
    volume = pod.volumes[mount["name"]]
    assert "subPath" not in mount, "a subPath mount is never updated: no reload on change"
    configmap = one(rendered, "ConfigMap", volume["configMap"]["name"])
    key = posixpath.relpath(config, mount["mountPath"])
    return check_text(configmap["data"][key], f"ConfigMap {configmap['metadata']['name']}").spec


def test_the_configmap_policy_is_valid_and_reloads_on_change(policy: PolicySpec) -> None:
    assert policy.agent.mode is AgentMode.KUBERNETES
    assert policy.agent.reload_on_change


@pytest.mark.parametrize(
    ("what", "host", "writable"),
    [
        ("cgroup root", "/sys/fs/cgroup", True),
        ("proc root", "/proc", False),
        ("CRI socket", CRI_SOCKET, False),
        ("pod resources socket", "/var/lib/kubelet/pod-resources/kubelet.sock", False),
        ("system bus", SYSTEM_BUS_ADDRESS.removeprefix("unix:path="), False),
        ("state file", "/var/lib/nodeagent/state.json", True),
        ("API socket", "/run/nodeagent/nodeagent.sock", True),
        ("node features", "/etc/kubernetes/node-feature-discovery/features.d/nodeagent", True),
    ],
)
def test_each_path_the_agent_opens_is_the_hosts(
    pod: Pod, policy: PolicySpec, what: str, host: str, writable: bool
) -> None:
    """Where the agent, run with the DaemonSet's arguments and the ConfigMap's policy, opens
    each file, and that it is the host's file (read-only where it only reads)."""
    opened = {
        "cgroup root": pod.arg("--cgroup-root"),
        "proc root": pod.arg("--proc-root"),
        "CRI socket": policy.agent.runtimes.containerd or "",
        "pod resources socket": policy.kubernetes.pod_resources_socket,
        "system bus": SYSTEM_BUS_ADDRESS.removeprefix("unix:path="),
        "state file": policy.agent.state_file,
        "API socket": policy.agent.socket,
        "node features": policy.publish.node_features or "",
    }[what]
    assert pod.host_path(opened) == (host, not writable)


@pytest.mark.parametrize(
    ("directory", "runtime", "host"),
    [
        ("deploy/kubernetes", "containerd", CRI_SOCKET),
        ("deploy/k3s", "containerd", "/run/k3s/containerd/containerd.sock"),  # rke2's too
        ("deploy/cri-o", "crio", "/run/crio/crio.sock"),
    ],
)
def test_each_runtimes_layout_mounts_its_cri_socket_where_the_policy_looks(
    directory: str, runtime: str, host: str
) -> None:
    """One policy for every runtime: each layout mounts its runtime's socket directory where
    the ConfigMap's policy names that runtime's socket, and differs from ../kubernetes in
    that volume alone."""
    docs = kustomize(directory)
    laid_out = Pod(one(docs, "DaemonSet"))
    configmap = one(docs, "ConfigMap")
    policy = check_text(configmap["data"]["policy.yaml"], directory).spec
    assert laid_out.host_path(getattr(policy.agent.runtimes, runtime)) == (host, True)
    base = kustomize("deploy/kubernetes")
    assert configmap == one(base, "ConfigMap")

    def by_name(daemonset: dict[str, Any]) -> dict[str, Any]:
        """The DaemonSet with its volumes by name (a patch may reorder the list)."""
        out = copy.deepcopy(daemonset)
        spec = out["spec"]["template"]["spec"]
        spec["volumes"] = {v["name"]: v for v in spec["volumes"]}
        return out

    unchanged = by_name(one(base, "DaemonSet"))
    unchanged["spec"]["template"]["spec"]["volumes"]["cri-socket"]["hostPath"]["path"] = (
        posixpath.dirname(host)
    )
    assert by_name(one(docs, "DaemonSet")) == unchanged


def test_the_pod_runs_as_a_node_agent(pod: Pod, policy: PolicySpec) -> None:
    spec, container = pod.spec, pod.container
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["hostPID"] is True  # NVML's PIDs are the host's
    assert {"operator": "Exists"} in spec["tolerations"]
    assert {
        "name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}
    } in container["env"]  # fmt: skip
    (port,) = (p for p in container["ports"] if p["name"] == "metrics")
    assert policy.agent.metrics.listen is not None
    assert parse_listen(policy.agent.metrics.listen)[1] == port["containerPort"]
    # restarted when its loop is stuck, as the unit's watchdog does; ready once it ticks
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
    # Guaranteed: every resource requested at its limit
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]
    assert set(resources["limits"]) == {"cpu", "memory"}
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}


def test_sockets_are_mounted_by_their_directories(pod: Pod) -> None:
    """A socket file mounted alone is the inode it was at the pod's start: after
    `systemctl restart containerd` it is refused for good. Its directory shows the new."""
    for name in ("cri-socket", "system-bus"):
        assert pod.volumes[name]["hostPath"]["type"] == "Directory", name
    assert not [v for v in pod.volumes.values() if v.get("hostPath", {}).get("type") == "Socket"]


def test_the_example_files_stay_in_step() -> None:
    """The policy the ConfigMap is made from is the one in the directory (no stale copy)."""
    kustomization = yaml.safe_load((ROOT / "deploy/kubernetes/kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    assert generator["files"] == ["policy.yaml"]
    assert Path(ROOT / "deploy/kubernetes/policy.yaml").exists()


def test_the_uninstall_releases_every_node_with_the_agents_view_of_the_host(
    pod: Pod, policy: PolicySpec
) -> None:
    """Issue 35 item 8: `kubectl delete -k deploy/kubernetes` left every cap and freeze in
    place (SIGTERM only saves the state, as a rolling update needs). deploy/uninstall runs
    `nodeagent release --all` on every node the agent runs on, reading the same host files
    the agent wrote, through the same policy."""
    docs = kustomize("deploy/uninstall")
    for doc in docs:
        assert problems(doc) == [], doc["kind"]
    daemonset = one(docs, "DaemonSet", "nodeagent-release")
    spec = copy.deepcopy(daemonset)["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    spec["containers"] = [init]
    release = Pod({"spec": {"template": {"spec": spec}}})
    assert init["command"] == ["nodeagent"] and init["args"][:2] == ["release", "--all"]
    assert init["image"] == pod.container["image"]
    for option in ("--config", "--cgroup-root"):
        assert release.arg(option) == pod.arg(option), option
    config = release.mount_of(release.arg("--config"))
    assert release.volumes[config["name"]] == pod.volumes[pod.mount_of(pod.arg("--config"))["name"]]
    for path, writes in [
        (pod.arg("--cgroup-root"), True),
        (policy.agent.state_file, True),  # what to hand back, updated after
        (policy.agent.socket, False),  # refused while an agent answers there
        (SYSTEM_BUS_ADDRESS.removeprefix("unix:path="), False),  # systemd's units
    ]:
        host, read_only = release.host_path(path)
        assert host == pod.host_path(path)[0], path
        assert read_only is not writes, path
    for key in ("tolerations", "nodeSelector", "priorityClassName"):
        assert spec[key] == pod.spec[key], key
    assert spec["automountServiceAccountToken"] is False  # it asks no API server
    base = yaml.safe_load((ROOT / "deploy/kubernetes/kustomization.yaml").read_text())
    mine = yaml.safe_load((ROOT / "deploy/uninstall/kustomization.yaml").read_text())
    assert mine["images"] == base["images"]


# --- GPU access (issue 35): the NVIDIA runtime class, or the host's driver library --------


def compose(tmp: Path, resources: list[str], components: list[str]) -> list[dict[str, Any]]:
    """A kustomization of an operator's own, as docs/kubernetes.md shows it: deploy/
    layouts as resources, deploy/components as components (kustomize wants both relative)."""

    def rel(path: str) -> str:
        return os.path.relpath(ROOT / path, tmp)

    layout = {"resources": [rel(r) for r in resources], "components": [rel(c) for c in components]}
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(layout))
    return kustomize(str(tmp))


def env_of(pod: Pod) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod.container["env"]}


def without(daemonset: dict[str, Any], volume: str | None = None) -> dict[str, Any]:
    """The DaemonSet less what a GPU component adds: the runtime class, the NVIDIA_* and
    LD_PRELOAD variables, and `volume` with its mount."""
    out = copy.deepcopy(daemonset)
    spec = out["spec"]["template"]["spec"]
    spec.pop("runtimeClassName", None)
    (container,) = spec["containers"]
    container["env"] = [
        e for e in container["env"]
        if not e["name"].startswith("NVIDIA_") and e["name"] != "LD_PRELOAD"
    ]  # fmt: skip
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != volume]
    spec["volumes"] = {v["name"]: v for v in spec["volumes"] if v["name"] != volume}
    return out


def test_the_runtime_class_overlay_sees_the_gpus_as_nvidias_daemonsets_do() -> None:
    """runtimeClassName nvidia with NVIDIA_VISIBLE_DEVICES=all and the `utility` capability
    (NVML, no CUDA), and nothing else changed: no nvidia.com/gpu request, so the device
    plugin counts no GPU as this pod's."""
    docs = kustomize("deploy/nvidia-runtime")
    daemonset = one(docs, "DaemonSet")
    laid_out = Pod(daemonset)
    assert laid_out.spec["runtimeClassName"] == "nvidia"
    env = env_of(laid_out)
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["NVIDIA_DRIVER_CAPABILITIES"]) == ("all", "utility")
    assert "LD_PRELOAD" not in env and "LD_LIBRARY_PATH" not in env
    resources = laid_out.container["resources"]
    assert not [r for part in resources.values() for r in part if r.startswith("nvidia.com/")]
    base = kustomize("deploy/kubernetes")
    assert without(daemonset) == without(one(base, "DaemonSet"))
    assert [d for d in docs if d["kind"] != "DaemonSet"] == [
        d for d in base if d["kind"] != "DaemonSet"
    ]


HOST_DRIVERS = [
    # component, the host's file the agent preloads, its directory's hostPath type, and the
    # runtime's layout it is tried on (each layout once: they compose alike)
    (
        "nvidia-host-driver",
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "Directory",
        "deploy/kubernetes",
    ),
    ("nvidia-host-driver-rhel", "/usr/lib64/libnvidia-ml.so.1", "Directory", "deploy/cri-o"),
    (
        "nvidia-host-driver-gpu-operator",
        "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "DirectoryOrCreate",
        "deploy/k3s",
    ),
]


@pytest.mark.parametrize(("component", "library", "kind", "base"), HOST_DRIVERS)
def test_the_host_driver_components_preload_the_hosts_nvml(
    tmp_path: Path, component: str, library: str, kind: str, base: str
) -> None:
    """Each host layout, on a runtime's layout: LD_PRELOAD names the host's
    libnvidia-ml.so.1 through a read-only mount of its directory (HostToContainer: a driver
    mounted later is seen), LD_LIBRARY_PATH is left alone (the host's libc would come
    before the image's), the pod stays privileged (the host's /dev/nvidia* nodes), and
    nothing else of the layout changes."""
    docs = compose(tmp_path, [base], [f"deploy/components/{component}"])
    daemonset = one(docs, "DaemonSet")
    assert problems(daemonset) == []  # the rest is the layout's own, checked above
    laid_out = Pod(daemonset)
    env = env_of(laid_out)
    assert "LD_LIBRARY_PATH" not in env and "runtimeClassName" not in laid_out.spec
    assert laid_out.host_path(env["LD_PRELOAD"]) == (library, True)
    mount = laid_out.mount_of(env["LD_PRELOAD"])
    assert mount["mountPropagation"] == "HostToContainer"
    assert laid_out.volumes[mount["name"]]["hostPath"]["type"] == kind
    assert laid_out.container["securityContext"]["privileged"] is True
    unchanged = kustomize(base)
    assert without(daemonset, mount["name"]) == without(one(unchanged, "DaemonSet"))
    assert [d for d in docs if d["kind"] != "DaemonSet"] == [
        d for d in unchanged if d["kind"] != "DaemonSet"
    ]


def test_the_host_driver_overlay_is_the_component_on_the_containerd_layout(
    tmp_path: Path,
) -> None:
    assert kustomize("deploy/nvidia-host-driver") == compose(
        tmp_path, ["deploy/kubernetes"], ["deploy/components/nvidia-host-driver"]
    )


STUB_NVML = """
/* A stand-in for the driver's libnvidia-ml.so.1 (no GPU here): what nvidia-ml-py calls
   to start NVML and count the GPUs, answering NVML_SUCCESS and no GPUs. */
int nvmlInitWithFlags(unsigned int flags) { return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = 0; return 0; }
"""


def gpus_reason(env: dict[str, str]) -> tuple[str, str]:
    """`nodeagent gpus --json`'s reason for having no GPUs, and its stderr, in `env`."""
    out = subprocess.run(
        [sys.executable, "-m", "nodeagent", "gpus", "--json", "--socket", "/nonexistent.sock"],
        capture_output=True, text=True, check=True, timeout=60,
        env={k: v for k, v in {**os.environ, **env}.items() if k != "NODEAGENT_GPU_SIM"},
    )  # fmt: skip
    reason: str = json.loads(out.stdout)["reason"]
    return reason, out.stderr


def test_a_preloaded_nvml_is_the_library_the_bindings_open(tmp_path: Path) -> None:
    """What the host-driver components rely on, with the real loader and the real
    nvidia-ml-py: a libnvidia-ml.so.1 preloaded by path, in a directory no search path
    names, is the one `dlopen("libnvidia-ml.so.1")` returns (matched by its soname). The
    driver cannot run here: a stand-in library built with the host's C compiler answers,
    and only its answer ("no GPUs") tells that it was the one opened. Where the file is
    missing, ld.so's one line and the agent's own reason, and the agent runs on."""
    docs = kustomize("deploy/nvidia-host-driver")
    laid_out = Pod(one(docs, "DaemonSet"))
    preload = env_of(laid_out)["LD_PRELOAD"]
    host_file, _ = laid_out.host_path(preload)
    host = tmp_path / "host"
    library = host / host_file.lstrip("/")
    library.parent.mkdir(parents=True)
    source = tmp_path / "nvml.c"
    source.write_text(STUB_NVML)
    compiler = shutil.which("cc")
    assert compiler, "no C compiler to build the stand-in libnvidia-ml.so.1 (apt install gcc)"
    real = library.with_name("libnvidia-ml.so.550.54.15")  # the driver's: a symlink to it
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(real),
         str(source)],
        check=True,
    )  # fmt: skip
    library.symlink_to(real.name)
    # the pod's view: the mount's directory is the host's, LD_PRELOAD as the pod has it
    mount = laid_out.mount_of(preload)
    in_pod = str(host) + laid_out.volumes[mount["name"]]["hostPath"]["path"]
    as_pod_sees = preload.replace(mount["mountPath"], in_pod, 1)
    assert gpus_reason({"LD_PRELOAD": as_pod_sees}) == ("NVML found no GPUs", "")
    missing = "libnvidia-ml.so.1 not found: no NVIDIA driver, or a container not given it"
    assert gpus_reason({})[0] == missing
    library.unlink()
    reason, stderr = gpus_reason({"LD_PRELOAD": as_pod_sees})
    assert reason == missing
    assert stderr == (
        f"ERROR: ld.so: object '{as_pod_sees}' from LD_PRELOAD cannot be preloaded"
        " (cannot open shared object file): ignored.\n"
    )


def test_the_docs_say_how_to_give_the_agent_the_gpus() -> None:
    said = (ROOT / "docs/kubernetes.md").read_text()
    for needed in (
        "kubectl apply -k deploy/nvidia-runtime", "kubectl apply -k deploy/nvidia-host-driver",
        "components/nvidia-host-driver-rhel", "components/nvidia-host-driver-gpu-operator",
        "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=utility", "LD_PRELOAD",
        "libnvidia-ml.so.1", "nodeagent gpus",
    ):  # fmt: skip
        assert needed in said, needed
