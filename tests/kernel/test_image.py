"""The container image ./scripts/package image builds (dist/nodeagent-VERSION.oci.tar, an OCI
archive), under podman in the VM: its command, and the shipped DaemonSet beside a busy
inference pod on a real kernel with a real containerd, without a cluster (issue 35).

podman runs in the VM itself with the cgroupfs manager, its storage on tmpfs (no registry: the
archive is loaded, the workload image is a one-layer busybox rootfs imported from a tar). The
DaemonSet's container is run as the kubelet with containerd would run it (`pod_run_args`): the
manifest's command, args, env (NODE_NAME from the downward API: this node's name), privileged
with the host's PID and cgroup namespaces, its CPU and memory limits, and every volumeMount at
its mountPath, read-only where the manifest says; what the kubelet adds to a pod with a service
account too (its token directory, KUBERNETES_SERVICE_HOST/PORT). Nothing of the pod spec is
retyped here. The policy is deploy/kubernetes/policy.yaml, read from the file (kustomize's
ConfigMap is that file unchanged), with one node-local substitution said where it is made.

What a volume's host side is on this node: the same path where the VM has it (/sys/fs/cgroup,
/proc, /run/containerd: Debian's containerd, tests/kernel/runtimes.py, at its default socket);
a dbus-daemon's socket for the system bus; a directory of this test for the agent's own state,
run and features.d directories; the Secret's token as the kubelet writes a Secret volume. Two
STAND-INS for what cannot run here: the kubelet's pod-resources directory is empty (no kubelet,
no GPU), and the API server the service account points at does not answer (nothing listens at
KUBERNETES_SERVICE_HOST in the pod's network namespace): the agent's watch fails and retries,
and each pod's namespace, labels and annotations come from the CRI, as the kubelet gave them.

The scenario (`test_the_shipped_daemonset_beside_a_busy_inference_pod`), pods made through
containerd's CRI as the kubelet makes them (runtimes.Cri):

1. kube-system/kube-proxy-0 lightly busy (a loop with sleeps), research-nlp/train-0 (no class:
   batch) and research-nlp/scavenger-0 (nodeagent.io/class: besteffort) busy, then
   prod-serving/serve-0 (nodeagent.io/class: inference) spinning more threads than the VM has
   CPUs: it stalls, and the shipped policy's protection caps the batch pod (cpu.max) and
   freezes the besteffort one; once serve-0 is removed both are released.
2. Throughout, kube-proxy's cgroups (its pod's, its container's, its sandbox's) and the
   agent's own container's cgroup are sampled: cpu.max and cgroup.freeze never change,
   cpu.weight is never below its first reading, and the agent's audit log has no
   cgroup.write to any of them that tightens (node-critical pods may be loosened: the
   sandbox's cpu.weight, 1 from containerd, is raised to 100; each such write is printed).
3. containerd restarted as a package upgrade does it (the main process stopped with SIGTERM,
   its shims and pods left running, started again from the same config: a new socket inode in
   the same directory): nodeagent_peer_up{peer="containerd"} goes to 0 and back to 1, and a pod
   made after it, prod-serving/serve-1 annotated inference, is claimed as tenant prod, class
   inference from the first scrape that shows it, within a few ticks (its metadata can only
   have come from the new socket).

The figures (`image: ...` lines, with -s) are the times to cap and freeze, to release, for the
metric to drop and recover, and to classify the new pod.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import runtimes as rt
import yaml
from conftest import CGROUP_ROOT, enable_controllers
from helpers import read, rel, wait_for, wait_until
from prometheus_client.parser import text_string_to_metric_families

CHECKOUT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["version"]
ARCHIVE = CHECKOUT / "dist" / f"nodeagent-{VERSION}.oci.tar"
DAEMONSET = CHECKOUT / "deploy" / "kubernetes" / "daemonset.yaml"
SHIPPED_POLICY = CHECKOUT / "deploy" / "kubernetes" / "policy.yaml"
IMAGE = f"localhost/nodeagent:{VERSION}"
WAIT_S = 300.0
LOAD_S = 600.0
"""`podman load` of the archive (70 MB, read over the VM's 9p, copied by vfs): more than
300 s under TCG while the host's two cores ran other VMs (load average 11)."""
pytestmark = pytest.mark.timeout(900)  # the image's load; the scenario's waits


class Podman:
    """podman in the VM, its storage and state in `root` (a tmpfs of the VM)."""

    def __init__(self, root: Path) -> None:
        self.argv = [
            "podman", "--root", str(root / "storage"), "--runroot", str(root / "run"),
            "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
        ]  # fmt: skip

    def __call__(self, *args: str, check: bool = True, timeout: float = WAIT_S) -> str:
        done = subprocess.run(
            [*self.argv, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def logs(self, name: str) -> str:
        """What the container wrote, stdout and stderr (the agent logs to stderr)."""
        done = subprocess.run(
            [*self.argv, "logs", name],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=WAIT_S,
            check=False,
        )  # fmt: skip
        return done.stdout


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    if not ARCHIVE.exists():
        pytest.fail(f"{ARCHIVE} is missing: ./scripts/package image builds it", pytrace=False)
    enable_controllers(CGROUP_ROOT)
    p = Podman(tmp_path_factory.mktemp("podman"))
    p("load", "-q", "-i", str(ARCHIVE), timeout=LOAD_S)
    yield p
    for name in p("ps", "-aq", check=False).split():
        p("rm", "-f", "-t", "0", name, check=False)


def test_the_image_runs_its_command(podman: Podman) -> None:
    config = json.loads(podman("image", "inspect", IMAGE))[0]["Config"]
    assert config["Entrypoint"] == ["/usr/bin/nodeagent"]
    assert config["Cmd"] == ["run", "--config", "/etc/nodeagent/policy.yaml"]
    run = ("run", "--rm", "--network", "none", IMAGE)
    assert podman(*run, "--version") == f"nodeagent, version {VERSION}\n"
    assert podman(*run, "example-policy") == (CHECKOUT / "config/policy.yaml").read_text()
    assert podman(*run, "validate", "/etc/nodeagent/policy.yaml").startswith(
        "/etc/nodeagent/policy.yaml: ok"
    )


def daemonset() -> dict[str, Any]:
    if not DAEMONSET.exists():
        pytest.fail(f"{DAEMONSET} is missing (issue 17.2's manifests)", pytrace=False)
    found: list[dict[str, Any]] = [
        d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d and d["kind"] == "DaemonSet"
    ]
    assert len(found) == 1, f"{DAEMONSET}: one DaemonSet expected"
    return found[0]


def size_for_podman(quantity: str) -> str:
    """A Kubernetes memory quantity (512Mi) as podman takes it (512m: podman's m is MiB)."""
    units = {"Ki": "k", "Mi": "m", "Gi": "g"}
    for suffix, short in units.items():
        if quantity.endswith(suffix):
            return quantity.removesuffix(suffix) + short
    return quantity


@contextlib.contextmanager
def message_bus(where: Path) -> Iterator[Path]:
    """A dbus-daemon of this test's own for the pod spec's system bus socket: the VM has no
    system bus outside the test systemd's mount namespace, whose socket cannot be bind-mounted
    into a container from here (crun: EINVAL). Nothing here needs systemd: the pods are
    containerd's under the cgroupfs driver, which the agent writes directly."""
    where.mkdir(parents=True)
    sock = where / "system_bus_socket"
    proc = subprocess.Popen(
        ["dbus-daemon", "--nofork", "--config-file=/usr/share/dbus-1/session.conf",
         f"--address=unix:path={sock}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        assert wait_for(sock.exists, WAIT_S, step=0.2), "dbus-daemon never made its socket"
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@dataclass
class Kubelet:
    """What this node's kubelet would give the DaemonSet's pod, where the VM has no such thing
    at the manifest's path: the host side of hostPath volumes (by host path), each ConfigMap's
    and Secret's data (by name, key to text), written as the kubelet writes those volumes, the
    service account's token directory and the API server's address (a stand-in: nothing
    answers there)."""

    hosts: dict[str, Path]
    config_maps: dict[str, dict[str, str]]
    secrets: dict[str, dict[str, str]]
    service_account: Path
    api_server: tuple[str, int]
    volumes: Path
    """Where ConfigMap and Secret volumes are written."""


def object_volume(kubelet: Kubelet, name: str, volume: dict[str, Any]) -> Path:
    """A ConfigMap or Secret volume's directory: every key, or the `items` asked for, each at
    its path with `defaultMode` (the kubelet's default 0644)."""
    kind, ref = ("configMap", "name") if "configMap" in volume else ("secret", "secretName")
    source = volume[kind]
    data = (kubelet.config_maps if kind == "configMap" else kubelet.secrets).get(source[ref])
    assert data is not None, f"volume {name}: no {kind} {source[ref]} on this node"
    items = source.get("items") or [{"key": k, "path": k} for k in data]
    where = kubelet.volumes / name
    where.mkdir(parents=True)
    for item in items:
        path = where / item["path"]
        path.write_text(data[item["key"]])
        path.chmod(source.get("defaultMode", 0o644))
    return where


def pod_run_args(spec: dict[str, Any], kubelet: Kubelet) -> list[str]:
    """`podman run` options for the DaemonSet's one container, as the kubelet would run it."""
    pod = spec["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    args = ["--name", "nodeagent", "--network", "none", "--cgroupns", "host"]
    if pod.get("hostPID"):
        args += ["--pid", "host"]
    if container.get("securityContext", {}).get("privileged"):
        args.append("--privileged")
    limits = container.get("resources", {}).get("limits", {})
    if "memory" in limits:
        args += ["--memory", size_for_podman(limits["memory"])]
    if "cpu" in limits:  # "1" or "500m": the kubelet's CFS quota, as podman's --cpus
        cpu = str(limits["cpu"])
        cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
        args += ["--cpus", f"{cores:g}"]
    for env in container.get("env", []):
        if "value" in env:
            value = env["value"]
        else:
            field = env["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == "spec.nodeName", f"env {env['name']}: {field} has no stand-in here"
            value = socket.gethostname()
        args += ["--env", f"{env['name']}={value}"]
    if pod.get("serviceAccountName") and pod.get("automountServiceAccountToken", True):
        # what the kubelet adds to every pod with a service account: the API server's
        # address, and the token directory the in-cluster configuration reads
        api_host, api_port = kubelet.api_server
        token_dir = f"{kubelet.service_account}:{SERVICE_ACCOUNT_DIR}:rbind,ro"
        args += ["--env", f"KUBERNETES_SERVICE_HOST={api_host}",
                 "--env", f"KUBERNETES_SERVICE_PORT={api_port}", "--volume", token_dir]  # fmt: skip
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume or "secret" in volume:
            source = object_volume(kubelet, mount["name"], volume)
        else:
            host = volume["hostPath"]
            source = kubelet.hosts.get(host["path"], Path(host["path"]))
            kind = host.get("type", "")
            if kind == "DirectoryOrCreate":
                source.mkdir(parents=True, exist_ok=True)
            assert source.exists(), f"volume {mount['name']}: {source} ({kind}) is missing"
        ro = ",ro" if mount.get("readOnly") else ""
        args += ["--volume", f"{source}:{mount['mountPath']}:rbind{ro}"]
    command = container.get("command", [])
    return [*args, *(["--entrypoint", json.dumps(command)] if command else []), IMAGE,
            *container.get("args", [])]  # fmt: skip


# -- the shipped DaemonSet beside a busy inference pod -----------------------------------------

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SPIN = "while :; do :; done"
LIGHT = ("sh", "-c", "while :; do i=0; while [ $i -lt 300 ]; do i=$((i+1)); done; sleep 1; done")
KEPT = ("cpu.max", "cpu.weight", "cgroup.freeze")
"""What is sampled of the cgroups that must never be touched."""
UNCAPPED = "max 100000"


def spinning(threads: int) -> tuple[str, ...]:
    """A container's command: `threads` busy loops."""
    return ("sh", "-c", " & ".join([SPIN] * threads) + " & wait")


@pytest.fixture(scope="module")
def containerd() -> Iterator[rt.Runtimes]:
    """Debian's containerd with its CRI plugin (runtimes.py; no dockerd nor podman API), at its
    default socket /run/containerd/containerd.sock: the DaemonSet's cri-socket volume as it is."""
    with rt.started(rt.InVm(), CGROUP_ROOT, daemons=("containerd",)) as r:
        wait_until(lambda: cri_ready(r), WAIT_S, "containerd's CRI to serve pods")
        yield r


def cri_ready(r: rt.Runtimes) -> bool:
    cri = r.cri()
    try:
        return cri.ready()
    finally:
        cri.close()


Sample = tuple[str, dict[str, str], float]


class Agent:
    """The DaemonSet's container, running: its /metrics (in its own network namespace, with
    the Secret's bearer token, as the ServiceMonitor scrapes it) and its cgroup."""

    def __init__(self, podman: Podman, name: str, token: str) -> None:
        self.podman, self.name, self.token = podman, name, token
        self.pid = int(podman("inspect", "-f", "{{.State.Pid}}", name).strip())
        cgroup = Path(f"/proc/{self.pid}/cgroup").read_text().split("::", 1)[1].strip()
        self.cgroup = CGROUP_ROOT / cgroup.lstrip("/")

    def scrape(self) -> list[Sample] | None:
        """The samples of one scrape; None when it did not answer (starting, or busy)."""
        done = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-n", "curl", "-sf", "--max-time", "20",
             "-H", f"Authorization: Bearer {self.token}", "http://127.0.0.1:9464/metrics"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            return None
        return [
            (s.name, s.labels, s.value)
            for family in text_string_to_metric_families(done.stdout)
            for s in family.samples
        ]

    def until(self, what: str, found: Callable[[list[Sample]], bool], timeout: float) -> float:
        """Scrape until `found` says yes; the seconds it took."""
        t0 = time.monotonic()
        ok = wait_for(lambda: (s := self.scrape()) is not None and found(s), timeout, step=0.5)
        if not ok:
            raise AssertionError(f"{what}: not within {timeout:.0f} s; the agent's log:\n"
                                 f"{self.podman.logs(self.name)[-3000:]}")  # fmt: skip
        return time.monotonic() - t0


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    return found[0] if found else None


def ticks(samples: list[Sample]) -> float:
    return value(samples, "nodeagent_ticks_total", result="ok") or 0.0


def owner(samples: list[Sample], pod: str, container: str) -> tuple[str, str] | None:
    """(tenant, class) of the pod's container as the agent claims it this tick."""
    for n, ls, _ in samples:
        if n == "nodeagent_workload_info" and (ls["pod"], ls["container_name"]) == (
            pod, container,
        ):  # fmt: skip
            return ls["tenant"], ls["class"]
    return None


class Sampler:
    """Reads KEPT of each cgroup under `tops` every half second, in a thread, keeping the
    first value read and every value seen of each file."""

    def __init__(self, tops: list[Path]) -> None:
        self.tops = tops
        self.first: dict[tuple[Path, str], str] = {}
        self.seen: dict[tuple[Path, str], set[str]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            for top in self.tops:
                for d in [top, *(p for p in top.rglob("*") if p.is_dir())]:
                    for name in KEPT:
                        with contextlib.suppress(OSError):
                            now = read(d, name)
                            self.first.setdefault((d, name), now)
                            self.seen.setdefault((d, name), set()).add(now)

    def close(self) -> list[str]:
        """What was tightened: a cpu.max or cgroup.freeze that changed, a cpu.weight read
        lower than it first was."""
        self.stop.set()
        self.thread.join(30)
        assert any(n == "cpu.max" for _, n in self.seen), "nothing was sampled"
        out = []
        for (d, name), values in self.seen.items():
            first = self.first[(d, name)]
            lowered = name == "cpu.weight" and min(map(int, values)) < int(first)
            if lowered or (name != "cpu.weight" and values != {first}):
                out.append(f"{d}/{name}: {first} then {sorted(values)}")
        return out


def tightening(write: dict[str, Any]) -> bool:
    """Whether an audited cgroup.write tightens: anything but a cpu.weight raised, a cap
    lifted or a thaw."""
    attribute, old, new = write.get("attribute"), str(write.get("old")), str(write.get("new"))
    if attribute == "cpu.weight" and old.isdigit() and new.isdigit():
        return int(new) < int(old)
    return not ((attribute, new.split()[0]) == ("cpu.max", "max") or
                (attribute, new) == ("cgroup.freeze", "0"))  # fmt: skip


def shipped_policy(managed: str) -> str:
    """deploy/kubernetes/policy.yaml as the ConfigMap holds it, with what this node must have
    otherwise: nothing else is changed."""
    policy = yaml.safe_load(SHIPPED_POLICY.read_text())
    # the VM's cgroup root serves the whole run: the managed root (exec's jobs, refused in
    # Kubernetes mode, but made at start) goes in this test's sandbox, removed after it,
    # rather than the default nodeagent.slice at the VM's root
    policy["agent"]["managed_root"] = managed
    return str(yaml.safe_dump(policy, sort_keys=False))


def test_the_shipped_daemonset_beside_a_busy_inference_pod(
    podman: Podman, containerd: rt.Runtimes, tmp_path: Path, managed: str
) -> None:
    r, spec = containerd, daemonset()
    cpus = os.cpu_count() or 2
    proxy = r.run_pod("kube-system", "kube-proxy-0", {"k8s-app": "kube-proxy"}, {},
                      {"kube-proxy": LIGHT})  # fmt: skip
    train = r.run_pod("research-nlp", "train-0", {"app": "train"}, {},
                      {"trainer": spinning(2)})  # fmt: skip
    scavenger = r.run_pod("research-nlp", "scavenger-0", {}, {"nodeagent.io/class": "besteffort"},
                          {"worker": spinning(1)})  # fmt: skip
    batch = train.containers["trainer"].cgroup
    besteffort = scavenger.containers["worker"].cgroup
    token = secrets.token_urlsafe(32)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("a token no API server checks here\n")
    (account / "namespace").write_text("nodeagent")
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", account / "ca.crt")
    with message_bus(tmp_path / "dbus") as bus:
        kubelet = Kubelet(
            hosts={
                "/run/dbus": bus.parent,
                "/var/lib/kubelet/pod-resources": tmp_path / "pod-resources",  # stand-in
                "/var/lib/nodeagent": tmp_path / "state",
                "/run/nodeagent": tmp_path / "run",
                "/etc/kubernetes/node-feature-discovery/features.d": tmp_path / "features.d",
            },
            config_maps={"nodeagent-policy": {"policy.yaml": shipped_policy(managed)}},
            secrets={"nodeagent-metrics-token": {"token": token}},
            service_account=account,
            api_server=("127.0.0.1", 443),  # stand-in: nothing listens in the pod's netns
            volumes=tmp_path / "volumes",
        )
        kubelet.hosts["/var/lib/kubelet/pod-resources"].mkdir()
        started = time.monotonic()
        podman("run", "-d", *pod_run_args(spec, kubelet))
        sampler: Sampler | None = None
        tightened: list[str] = []
        try:
            agent = Agent(podman, "nodeagent", token)
            sampler = Sampler([proxy.cgroup, agent.cgroup])
            everyone = (("kube-proxy-0", "kube-proxy"), ("train-0", "trainer"),
                        ("scavenger-0", "worker"))  # fmt: skip
            agent.until("the three pods claimed", lambda s: all(owner(s, *p) for p in everyone),
                        WAIT_S)  # fmt: skip
            first = time.monotonic() - started
            samples = agent.scrape() or []
            assert owner(samples, "kube-proxy-0", "kube-proxy") == ("system", "batch")
            assert owner(samples, "train-0", "trainer") == ("research", "batch")
            assert owner(samples, "scavenger-0", "worker") == ("research", "besteffort")
            print(f"image: the agent started and claimed the pods in {first:.1f} s")
            assert (tmp_path / "run" / "nodeagent.sock").exists(), "the API socket, on the host"

            # inference stalls: the batch pod capped, the besteffort one frozen
            assert (read(batch, "cpu.max"), read(besteffort, "cgroup.freeze")) == (UNCAPPED, "0")
            t0 = time.monotonic()  # its threads spin from within the call
            serve = r.run_pod("prod-serving", "serve-0", {"app": "serve"},
                              {"nodeagent.io/class": "inference"},
                              {"server": spinning(cpus + 1)})  # fmt: skip
            assert wait_for(lambda: read(batch, "cpu.max") != UNCAPPED, WAIT_S, step=0.5), (
                f"train-0 never capped; the agent's log:\n{podman.logs('nodeagent')[-3000:]}"
            )
            capped = time.monotonic() - t0
            assert wait_for(lambda: read(besteffort, "cgroup.freeze") == "1", WAIT_S, step=0.5), (
                f"scavenger-0 never frozen; the agent's log:\n{podman.logs('nodeagent')[-3000:]}"
            )
            frozen = time.monotonic() - t0
            cap = read(batch, "cpu.max")
            assert owner(agent.scrape() or [], "serve-0", "server") == ("prod", "inference")
            print(f"image: serve-0 ({cpus + 1} threads, {cpus} CPUs) stalls: train-0 capped"
                  f" after {capped:.1f} s (cpu.max {cap}), scavenger-0 frozen after"
                  f" {frozen:.1f} s")  # fmt: skip
            r.remove_pod(serve)
            t0 = time.monotonic()

            def released() -> bool:
                return (read(batch, "cpu.max"), read(besteffort, "cgroup.freeze")) == (
                    UNCAPPED, "0",
                )  # fmt: skip

            assert wait_for(released, WAIT_S, step=0.5), (
                f"cpu.max {read(batch, 'cpu.max')}, cgroup.freeze"
                f" {read(besteffort, 'cgroup.freeze')} after serve-0 left"
            )
            print(f"image: serve-0 removed: train-0 uncapped and scavenger-0 thawed after"
                  f" {time.monotonic() - t0:.1f} s")  # fmt: skip

            # containerd restarted as an upgrade restarts it
            sock = Path(r.paths.containerd)
            inode = sock.stat().st_ino
            r.stop_daemon("containerd")  # SIGTERM to containerd alone: shims and pods run on
            down = agent.until("nodeagent_peer_up{peer=containerd} 0 once it stopped",
                               lambda s: value(s, "nodeagent_peer_up", peer="containerd") == 0,
                               WAIT_S)  # fmt: skip
            r.start_daemon("containerd")
            t0 = time.monotonic()
            wait_until(lambda: cri_ready(r), WAIT_S, "containerd's CRI again")
            assert sock.stat().st_ino != inode, "a new socket in the same directory"
            agent.until("nodeagent_peer_up{peer=containerd} 1 once it is back",
                        lambda s: value(s, "nodeagent_peer_up", peer="containerd") == 1,
                        WAIT_S)  # fmt: skip
            up = time.monotonic() - t0
            print(f"image: containerd stopped: nodeagent_peer_up 0 after {down:.1f} s; started"
                  f" again (new socket inode): 1 after {up:.1f} s")  # fmt: skip
            r.run_pod("prod-serving", "serve-1", {"app": "serve"},
                      {"nodeagent.io/class": "inference"},
                      {"server": ("sleep", "3600")})  # fmt: skip
            t0, since = time.monotonic(), ticks(agent.scrape() or [])
            claims: list[tuple[tuple[str, str], float]] = []

            def claimed(s: list[Sample]) -> bool:
                found = owner(s, "serve-1", "server")
                if found is not None:
                    claims.append((found, ticks(s) - since))
                return found is not None

            took = agent.until("serve-1 claimed", claimed, WAIT_S)
            (first_claim, after_ticks) = claims[0]
            # the first scrape that shows it: no tick claimed it without containerd's answer
            assert first_claim == ("prod", "inference"), claims
            print(f"image: serve-1, made after the restart, claimed as prod/inference"
                  f" {took:.1f} s and {after_ticks:.0f} ticks after it started")  # fmt: skip
            assert after_ticks <= 3, f"{after_ticks:.0f} ticks"
        finally:
            if sampler is not None:
                tightened = sampler.close()
            if not r.place.alive("containerd"):
                r.start_daemon("containerd")
            logs = podman.logs("nodeagent")
            podman("rm", "-f", "-t", "5", "nodeagent", check=False)
            r.remove_pods()
    # never tightened: kube-proxy's cgroups and the agent's own, sampled and in the audit log
    assert not tightened, f"tightened: {tightened}"
    records = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    writes = [w for w in records if w.get("event") == "cgroup.write"]
    kept = [f"{rel(proxy.cgroup)}/", f"{rel(agent.cgroup)}/"]
    touched = [w for w in writes if any(k in str(w["path"]) for k in kept)]
    print(f"image: {len(writes)} cgroup writes audited, {len(touched)} to kube-proxy's cgroups"
          f" or the agent's own: {[(w['path'], w['old'], w['new']) for w in touched]}")  # fmt: skip
    assert not [w for w in touched if tightening(w)], touched
    assert any(rel(batch) in str(w["path"]) for w in writes), "train-0's cap in the audit log"
