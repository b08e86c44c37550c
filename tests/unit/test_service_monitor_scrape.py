"""The shipped ServiceMonitor, run by Debian's real Prometheus against the daemon's real
metrics endpoint: the workloads' `namespace` and `pod` arrive as the agent wrote them,
`instance` is the node's name and the bearer token from the Secret opens /metrics.

The YAML alone cannot show this: `honorLabels` and `authorization` only mean something
once a Prometheus scrapes with them. What cannot run here is a Kubernetes cluster and the
Prometheus Operator, so two stand-ins take their place, both derived from the objects
`kubectl kustomize deploy/kubernetes` renders: `operator_scrape_config` translates the
ServiceMonitor into the scrape config the operator would generate (and fails on any field
it does not know, so that a later edit of the ServiceMonitor cannot go untested), and
`endpoints_target` gives a static target the `__meta_kubernetes_*` labels that endpoints
discovery would give the agent's pod. Everything else is real: the `prometheus` binary
(.venv/bin, unpacked from Debian's package by scripts/lib.sh ensure_prometheus), its
relabeling, scraping and query API, and the agent's MetricsServer with its token file.

Two controls show that the test can fail: the same ServiceMonitor without `honorLabels`
gives `exported_namespace` and `exported_pod`, and without `authorization` the target is
down with the endpoint's 401. All three scrape in one Prometheus (one start: its discovery
hands targets over only every 5 s), as three nodes of one cluster.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from builders import POD_UID
from kube_schemas import kustomize
from test_metrics_server import free_port
from ticks import A1, K8S, record, state

from nodeagent.meta import ContainerMeta, PodMeta
from nodeagent.metrics.collector import TickCollector
from nodeagent.metrics.server import MetricsServer

PROMETHEUS = Path(sys.executable).with_name("prometheus")
SCRAPE_INTERVAL = "1s"
"""The test's scrape interval, in place of the ServiceMonitor's (the one field not carried
over as it is): a target is scraped within a second of being discovered."""
WORKLOAD = PodMeta("shop", "web-0", POD_UID)
"""The pod whose container the agent manages: its series carry this namespace and pod."""
TOKEN = "s3cret-scrape-token"
"""The Secret's value, as `kubectl create secret generic` would hold it."""


def _known(obj: Mapping[str, Any], where: str, fields: set[str]) -> None:
    unknown = sorted(set(obj) - fields)
    assert not unknown, (
        f"{where} has {', '.join(unknown)}, which operator_scrape_config does not "
        "translate: teach it what the Prometheus Operator generates for it"
    )


def operator_scrape_config(
    monitor: Mapping[str, Any], secrets: Mapping[str, Mapping[str, str]], tmp: Path
) -> list[dict[str, Any]]:
    """STAND-IN for the Prometheus Operator: the scrape configs it generates for
    `monitor` (one per endpoint), as pkg/prometheus/promcfg.go's
    generateServiceMonitorConfig writes them, except that the kubernetes_sd_configs are
    left out (the caller adds a static target, see endpoints_target), the scrape
    interval is SCRAPE_INTERVAL, and the Secret's key is given as a credentials_file
    (written under `tmp`) where the operator inlines it. `secrets` is the cluster's
    Secrets in the monitor's namespace: name -> key -> value.

    Every field of the ServiceMonitor is either translated or fails the test."""
    namespace, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    spec = monitor["spec"]
    _known(spec, "ServiceMonitor spec", {"selector", "jobLabel", "endpoints"})
    _known(spec["selector"], "ServiceMonitor selector", {"matchLabels"})
    keep_service = [
        {
            "action": "keep",
            "source_labels": [
                f"__meta_kubernetes_service_label_{_sanitized(k)}",
                f"__meta_kubernetes_service_labelpresent_{_sanitized(k)}",
            ],
            "regex": f"({v});true",
        }
        for k, v in sorted(spec["selector"]["matchLabels"].items())
    ]
    configs = []
    for i, endpoint in enumerate(spec["endpoints"]):
        where = f"ServiceMonitor endpoint {i}"
        _known(
            endpoint,
            where,
            {"port", "path", "interval", "honorLabels", "authorization", "relabelings"},
        )
        config: dict[str, Any] = {
            "job_name": f"serviceMonitor/{namespace}/{name}/{i}",
            "honor_labels": endpoint.get("honorLabels", False),
        }
        if "interval" in endpoint:
            assert re.fullmatch(r"(\d+[smh])+", endpoint["interval"]), endpoint["interval"]
            config["scrape_interval"] = SCRAPE_INTERVAL
        if "path" in endpoint:
            config["metrics_path"] = endpoint["path"]
        if "authorization" in endpoint:
            config["authorization"] = _authorization(
                endpoint["authorization"], secrets, tmp / f"credentials-{name}-{i}"
            )
        port = endpoint["port"]
        target = [
            "__meta_kubernetes_endpoint_address_target_kind",
            "__meta_kubernetes_endpoint_address_target_name",
        ]
        relabel = [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            *keep_service,
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                "regex": port,
            },
            {
                "source_labels": target,
                "separator": ";",
                "regex": "Node;(.*)",
                "replacement": "${1}",
                "target_label": "node",
            },
            {
                "source_labels": target,
                "separator": ";",
                "regex": "Pod;(.*)",
                "replacement": "${1}",
                "target_label": "pod",
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {
                "source_labels": ["__meta_kubernetes_pod_container_name"],
                "target_label": "container",
            },
            {
                "action": "drop",
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)",
            },
            {
                "source_labels": ["__meta_kubernetes_service_name"],
                "target_label": "job",
                "replacement": "${1}",
            },
        ]
        if "jobLabel" in spec:
            relabel.append(
                {
                    "source_labels": [
                        f"__meta_kubernetes_service_label_{_sanitized(spec['jobLabel'])}"
                    ],
                    "target_label": "job",
                    "regex": "(.+)",
                    "replacement": "${1}",
                }
            )
        relabel.append({"target_label": "endpoint", "replacement": port})
        relabel += [
            _relabeling(r, f"{where} relabeling {j}")
            for j, r in enumerate(endpoint.get("relabelings", []))
        ]
        # one shard: the operator's sharding keeps every target
        relabel += [
            {
                "source_labels": ["__address__"],
                "target_label": "__tmp_hash",
                "modulus": 1,
                "action": "hashmod",
            },
            {"source_labels": ["__tmp_hash"], "regex": "0", "action": "keep"},
        ]
        config["relabel_configs"] = relabel
        configs.append(config)
    return configs


def _sanitized(label: str) -> str:
    """A Kubernetes label's name as discovery writes it into a meta label's."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _authorization(
    auth: Mapping[str, Any], secrets: Mapping[str, Mapping[str, str]], path: Path
) -> dict[str, str]:
    _known(auth, "ServiceMonitor authorization", {"type", "credentials"})
    ref = auth["credentials"]
    _known(ref, "ServiceMonitor authorization credentials", {"name", "key"})
    assert ref["key"] in secrets.get(ref["name"], {}), (
        f"the ServiceMonitor sends key {ref['key']} of Secret {ref['name']}, which the "
        f"cluster lacks (it has {sorted((n, k) for n in secrets for k in secrets[n])})"
    )
    path.write_text(secrets[ref["name"]][ref["key"]])
    return {"type": auth.get("type", "Bearer"), "credentials_file": str(path)}


def _relabeling(r: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One of the ServiceMonitor's relabelings, as generateRelabelConfig writes it."""
    fields = {
        "sourceLabels": "source_labels", "separator": "separator",
        "targetLabel": "target_label", "regex": "regex", "modulus": "modulus",
        "replacement": "replacement", "action": "action",
    }  # fmt: skip
    _known(r, where, set(fields))
    out = {fields[k]: v for k, v in r.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def endpoints_target(
    address: str, node: str, service: Mapping[str, Any], daemonset: Mapping[str, Any]
) -> dict[str, Any]:
    """STAND-IN for Kubernetes endpoints discovery: a static target at `address` with the
    meta labels discovery gives the endpoint of the agent's pod on `node`, from the
    rendered Service and DaemonSet (a DaemonSet's pod is named after it)."""
    (port,) = service["spec"]["ports"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    pod = f"{daemonset['metadata']['name']}-{node[-1] * 5}"
    labels = {
        "__meta_kubernetes_namespace": service["metadata"]["namespace"],
        "__meta_kubernetes_service_name": service["metadata"]["name"],
        "__meta_kubernetes_endpoint_port_name": port["name"],
        "__meta_kubernetes_endpoint_ready": "true",
        "__meta_kubernetes_endpoint_address_target_kind": "Pod",
        "__meta_kubernetes_endpoint_address_target_name": pod,
        "__meta_kubernetes_pod_name": pod,
        "__meta_kubernetes_pod_node_name": node,
        "__meta_kubernetes_pod_container_name": container["name"],
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_ready": "true",
    }
    for k, v in service["metadata"].get("labels", {}).items():
        labels[f"__meta_kubernetes_service_label_{_sanitized(k)}"] = v
        labels[f"__meta_kubernetes_service_labelpresent_{_sanitized(k)}"] = "true"
    return {"targets": [address], "labels": labels}


class Prometheus:
    """Debian's prometheus, on loopback with its data under `home`."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = free_port()
        self.log = home / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, config: Mapping[str, Any]) -> None:
        assert PROMETHEUS.exists(), f"no {PROMETHEUS}: ./scripts/test installs it"
        self.home.mkdir(parents=True, exist_ok=True)
        path = self.home / "prometheus.yml"
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    str(PROMETHEUS),
                    f"--config.file={path}",
                    f"--storage.tsdb.path={self.home / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def api(self, path: str, **query: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as response:  # loopback only
            answer = json.load(response)
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=promql)["result"]
        return result

    def targets(self) -> tuple[list[dict[str, Any]], int]:
        """The active targets and how many relabeling dropped, once Prometheus answers."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(
                f"prometheus exited {self.process.returncode}:\n{self.log.read_text()[-3000:]}"
            )
        try:
            found = self.api("targets", state="any")
        except OSError:  # not listening yet
            return [], 0
        return found["activeTargets"], len(found["droppedTargets"])

    def wait_scraped(self, instances: set[str], timeout: float = 30.0) -> dict[str, Any]:
        """The targets by `instance` once as many as `instances` have been scraped and
        their samples can be queried (`up` is committed with them); fails naming each
        target, its health and lastError, if they are not those."""
        deadline = time.monotonic() + timeout
        while True:
            targets, dropped = self.targets()
            scraped = [t for t in targets if t["health"] != "unknown"]
            if len(scraped) == len(instances) and len(self.query("up")) == len(instances):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        found = {t["labels"].get("instance"): t for t in scraped}
        said = "\n".join(
            f"  {t['scrapePool']}: instance {t['labels'].get('instance')}, {t['health']}, "
            f"lastError {t['lastError']!r}"
            for t in targets
        )
        assert set(found) == instances, (
            f"Prometheus scraped {sorted(map(str, found))}, not {sorted(instances)} "
            f"(waiting at most {timeout:g} s); its {len(targets)} targets "
            f"({dropped} more dropped by relabeling):\n{said}"
        )
        return found


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path / "prometheus")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, Any]]:
    """The objects of deploy/kubernetes by kind (one each of those used here)."""
    docs = kustomize("deploy/kubernetes")
    wanted = ("ServiceMonitor", "Service", "DaemonSet")
    found = {kind: [d for d in docs if d["kind"] == kind] for kind in wanted}
    assert all(len(v) == 1 for v in found.values()), {k: len(v) for k, v in found.items()}
    return {kind: v[0] for kind, v in found.items()}


def mounted_secrets(daemonset: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The Secrets the agent's pod mounts, holding TOKEN: what the install creates
    (docs/kubernetes.md) and the ServiceMonitor must send."""
    volumes = daemonset["spec"]["template"]["spec"]["volumes"]
    return {
        v["secret"]["secretName"]: {item["key"]: TOKEN for item in v["secret"]["items"]}
        for v in volumes
        if "secret" in v
    }


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[MetricsServer]:
    """The daemon's metrics server behind a token, after a tick in which it manages a job
    and WORKLOAD's container (its runtime named the pod)."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    container = replace(K8S, meta=ContainerMeta("containerd", "server", pod=WORKLOAD))
    collector = TickCollector()
    collector.observe(record([state(A1, 1.0), state(container, 0.5)]))
    server = MetricsServer.start(
        f"127.0.0.1:{free_port()}", collector, bearer_token_file=str(token)
    )
    yield server
    server.close()


def test_prometheus_scrapes_the_agent_as_the_service_monitor_says(
    tmp_path: Path,
    rendered: dict[str, dict[str, Any]],
    endpoint: MetricsServer,
    prometheus: Prometheus,
) -> None:
    # one node (instance) each: the shipped ServiceMonitor, and one without each field
    shipped = rendered["ServiceMonitor"]
    variants = {"node-a": shipped}
    for node, drop in (("node-b", "honorLabels"), ("node-c", "authorization")):
        monitor = copy.deepcopy(shipped)
        monitor["metadata"]["name"] += "-" + node
        for e in monitor["spec"]["endpoints"]:
            del e[drop]
        variants[node] = monitor
    secrets = mounted_secrets(rendered["DaemonSet"])
    address = f"127.0.0.1:{endpoint.port}"
    scrape_configs = []
    for node, monitor in variants.items():
        (config,) = operator_scrape_config(monitor, secrets, tmp_path)
        target = endpoints_target(address, node, rendered["Service"], rendered["DaemonSet"])
        scrape_configs.append({**config, "static_configs": [target]})
    prometheus.start({"scrape_configs": scrape_configs})
    targets = prometheus.wait_scraped(set(variants))

    # the shipped ServiceMonitor: up, as the node's name, with the workload's own labels
    assert targets["node-a"]["health"] == "up", targets["node-a"]["lastError"]
    up = prometheus.query('up{job="nodeagent"} == 1')
    assert sorted(s["metric"]["instance"] for s in up) == ["node-a", "node-b"], up
    (info,) = prometheus.query(f'nodeagent_workload_info{{instance="node-a",pod_uid="{POD_UID}"}}')
    labels = info["metric"]
    assert (labels["namespace"], labels["pod"]) == (WORKLOAD.namespace, WORKLOAD.name), labels
    assert labels["container_name"] == "server"
    assert labels["job"] == "nodeagent"
    assert not [k for k in labels if k.startswith("exported_")], labels
    # a series with no namespace of its own keeps the target's: the agent's pod
    (ticks,) = prometheus.query('nodeagent_ticks_total{instance="node-a",result="ok"}')
    agent_namespace = rendered["Service"]["metadata"]["namespace"]
    assert ticks["metric"]["namespace"] == agent_namespace
    assert ticks["metric"]["pod"].startswith(rendered["DaemonSet"]["metadata"]["name"] + "-")

    # control: without honorLabels the target's namespace and pod win
    (info,) = prometheus.query(f'nodeagent_workload_info{{instance="node-b",pod_uid="{POD_UID}"}}')
    labels = info["metric"]
    assert (labels["exported_namespace"], labels["exported_pod"]) == (
        WORKLOAD.namespace,
        WORKLOAD.name,
    ), labels
    assert labels["namespace"] == agent_namespace

    # control: without the token the endpoint refuses the scrape
    assert targets["node-c"]["health"] == "down"
    assert "401" in targets["node-c"]["lastError"], targets["node-c"]["lastError"]
    assert prometheus.query('up{instance="node-c"}')[0]["value"][1] == "0"


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda m: m["spec"].update(targetLabels=["team"]), "targetLabels"),
        (lambda m: m["spec"]["endpoints"][0].update(scheme="https"), "scheme"),
        (lambda m: m["spec"]["endpoints"][0]["relabelings"][0].update(foo=1), "foo"),
    ],
)
def test_a_field_the_stand_in_does_not_know_fails(
    tmp_path: Path, rendered: dict[str, dict[str, Any]], edit: Any, named: str
) -> None:
    """A later field of the ServiceMonitor fails the scrape test rather than being
    dropped from the config Prometheus runs, untested."""
    monitor = copy.deepcopy(rendered["ServiceMonitor"])
    edit(monitor)
    secrets = mounted_secrets(rendered["DaemonSet"])
    with pytest.raises(AssertionError, match=f"has {named}, which operator_scrape_config"):
        operator_scrape_config(monitor, secrets, tmp_path)
