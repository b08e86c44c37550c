"""The container image ./scripts/package image builds (dist/nodeagent-VERSION.oci.tar, an OCI
archive), under podman in the VM: its command, and the DaemonSet's pod spec on a real kernel
without a cluster.

podman runs in the VM itself with the cgroupfs manager, its storage on tmpfs (no registry: the
archive is loaded, the workload image is a one-layer busybox rootfs imported from a tar). The
DaemonSet's container is run as the kubelet with containerd would run it: the manifest's
command, args, env (NODE_NAME from the downward API: this node's name), privileged with the
host's PID and cgroup namespaces, its memory limit, and every volumeMount at its mountPath,
read-only where the manifest says. Nothing of the pod spec is retyped here. What the host side of
a volume is on this node: the same path where the node has it (/sys/fs/cgroup, /proc); a
dbus-daemon's socket for the system bus; a directory of this test for the agent's own state,
run and features.d directories and the kubelet's pod-resources directory (no kubelet runs here:
a stand-in); a containerd started here for the CRI socket; the policy volume holds this test's
policy (the ConfigMap's is for a cluster's pods, which no kubelet makes here).
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import tarfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CGROUP_ROOT, enable_controllers
from helpers import read, wait_for

CHECKOUT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["version"]
ARCHIVE = CHECKOUT / "dist" / f"nodeagent-{VERSION}.oci.tar"
DAEMONSET = CHECKOUT / "deploy" / "kubernetes" / "daemonset.yaml"
IMAGE = f"localhost/nodeagent:{VERSION}"
BUSYBOX_IMAGE = "localhost/nodeagent-test/busybox:1"
WAIT_S = 300.0
pytestmark = pytest.mark.timeout(900)  # the image's load and start may each wait WAIT_S
APPLETS = ("sh", "sleep", "true")


def busybox_rootfs() -> bytes:
    """A one-layer root filesystem: busybox-static and a few applets, as a tar."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:

        def add(name: str, kind: bytes = tarfile.DIRTYPE, data: bytes = b"", **kw: Any) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.size = kind, kw.pop("mode", 0o755), len(data)
            for k, v in kw.items():
                setattr(info, k, v)
            tar.addfile(info, io.BytesIO(data) if data else None)

        for d in ("bin", "dev", "etc", "proc", "sys", "tmp"):
            add(d)
        add("bin/busybox", tarfile.REGTYPE, Path("/bin/busybox").read_bytes())
        for applet in APPLETS:
            add(f"bin/{applet}", tarfile.SYMTYPE, linkname="busybox", mode=0o777)
    return out.getvalue()


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
    p("load", "-q", "-i", str(ARCHIVE))
    tar = tmp_path_factory.mktemp("busybox") / "rootfs.tar"
    tar.write_bytes(busybox_rootfs())
    p("import", "-q", str(tar), BUSYBOX_IMAGE)
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
def containerd(where: Path) -> Iterator[Path]:
    """A containerd of this test's own (cgroupfs), for the pod spec's CRI socket."""
    where.mkdir(parents=True)
    sock = where / "containerd.sock"
    log = (where / "containerd.log").open("wb")
    proc = subprocess.Popen(
        ["containerd", "--address", str(sock), "--root", str(where / "root"),
         "--state", str(where / "state")],
        stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    try:
        assert wait_for(sock.exists, WAIT_S, step=0.2), (where / "containerd.log").read_text()
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


@contextlib.contextmanager
def message_bus(where: Path) -> Iterator[Path]:
    """A dbus-daemon of this test's own for the pod spec's system bus socket: the VM has no
    system bus outside the test systemd's mount namespace, whose socket cannot be bind-mounted
    into a container from here (crun: EINVAL). Nothing here needs systemd: the workload is a
    podman container under the cgroupfs manager, which the agent writes directly."""
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


def pod_run_args(spec: dict[str, Any], hosts: dict[str, Path], policy_dir: Path) -> list[str]:
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
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            source = policy_dir
        else:
            host = volume["hostPath"]
            source = hosts.get(host["path"], Path(host["path"]))
            kind = host.get("type", "")
            if kind == "DirectoryOrCreate":
                source.mkdir(parents=True, exist_ok=True)
            assert source.exists(), f"volume {mount['name']}: {source} ({kind}) is missing"
        ro = ",ro" if mount.get("readOnly") else ""
        args += ["--volume", f"{source}:{mount['mountPath']}:rbind{ro}"]
    command = container.get("command", [])
    return [*args, *(["--entrypoint", json.dumps(command)] if command else []), IMAGE,
            *container.get("args", [])]  # fmt: skip


def test_the_daemonsets_pod_spec_manages_real_containers(
    podman: Podman, tmp_path: Path, managed: str
) -> None:
    spec = daemonset()
    workload = podman("run", "-d", "--network", "none", BUSYBOX_IMAGE, "sleep", "3600").strip()
    cgroup = CGROUP_ROOT / "libpod_parent" / f"libpod-{workload}"
    assert wait_for(cgroup.exists, WAIT_S, step=0.2), f"no {cgroup}"
    policy_dir = tmp_path / "policy"
    policy_dir.mkdir()
    (policy_dir / "policy.yaml").write_text(f"""\
version: 1
agent: {{managed_root: {managed}}}
tenants: {{research: {{shares: 1}}}}
rules:
  - name: the-workload
    match: {{runtime: podman, container_id: "{workload[:12]}"}}
    tenant: research
    limits: {{cpu_max: 0.3}}
""")  # fmt: skip
    with containerd(tmp_path / "containerd") as cri, message_bus(tmp_path / "dbus") as bus:
        hosts = {
            # the sockets' directories, as the DaemonSet mounts them (a restarted runtime's
            # new socket is seen)
            "/run/containerd": cri.parent,
            "/run/dbus": bus.parent,
            "/var/lib/kubelet/pod-resources": tmp_path / "pod-resources",  # stand-in
            "/var/lib/nodeagent": tmp_path / "state",
            "/run/nodeagent": tmp_path / "run",
            "/etc/kubernetes/node-feature-discovery/features.d": tmp_path / "features.d",
        }
        hosts["/var/lib/kubelet/pod-resources"].mkdir()
        args = pod_run_args(spec, hosts, policy_dir)
        agent = podman("run", "-d", *args).strip()
        try:

            def capped() -> bool:
                return read(cgroup, "cpu.max") == "30000 100000"

            t0 = time.monotonic()
            ok = wait_for(capped, WAIT_S, step=0.5)
            logs = podman.logs(agent)
            assert ok, f"cpu.max {read(cgroup, 'cpu.max')}; the agent's log:\n{logs[-3000:]}"
            records = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
            writes = [r for r in records if r.get("event") == "cgroup.write"]
            mine = [r for r in writes if str(r["path"]).endswith(f"libpod-{workload}/cpu.max")]
            assert mine, f"no cpu.max write in the agent's log:\n{logs[-3000:]}"
            print(f"image: the audit line: {json.dumps(mine[0])}")
            assert (tmp_path / "run" / "nodeagent.sock").exists(), "the API socket, on the host"
            took = time.monotonic() - t0
            print(f"image: the pod spec's agent capped the container in {took:.1f} s")
        finally:
            podman("rm", "-f", "-t", "5", agent, check=False)
            podman("rm", "-f", "-t", "0", workload, check=False)
