"""Real container runtimes for the kernel tests: Debian's containerd (its CRI plugin too), dockerd
and podman, each under the cgroupfs driver in the VM itself and under the systemd driver inside
the real systemd of systemd_host.py.

``./scripts/test`` installs the packages on the host's filesystem (scripts/lib.sh
``ensure_runtimes``) and never starts them there: they are started here, in the VM, once per
session and driver (the fixtures in test_runtimes.py), with their state on tmpfs:

- **cgroupfs**: plain processes in a cgroup of their own, at the runtimes' default sockets
  (``/run/containerd/containerd.sock``, ``/run/docker.sock``, ``/run/podman/podman.sock``) on the
  VM's tmpfs ``/run``. Their containers sit where the cgroupfs driver puts them:
  ``docker/<id>``, ``libpod_parent/libpod-<id>``, ``kubepods/burstable/pod<uid>/<id>``.
- **systemd**: units of the test systemd (``Delegate=yes``), state on its own tmpfs ``/run``,
  sockets in ``/srv/nodeagent-runtimes/`` (a directory both the VM and systemd's mount namespace
  see), containers in ``system.slice/docker-<id>.scope``, ``machine.slice/libpod-<id>.scope``,
  ``kubepods.slice/.../cri-containerd-<id>.scope`` of systemd's cgroup tree.

No registry is reachable: the one image is a one-layer rootfs of ``busybox-static``
(:func:`rootfs_tar`), imported into each runtime: ``docker import``, ``podman import``, and as an
OCI archive (:func:`oci_archive`) ``ctr -n k8s.io images import``; the CRI sandbox ("pause")
image is the same rootfs with ``sleep`` as its command, under the name containerd's config gives
as ``sandbox_image``. Kubernetes pods are made without a kubelet, through the CRI as the kubelet
calls it (:class:`Cri`): kubelet-shaped metadata, labels and annotations, host networking (no
CNI), and the ``cgroup_parent`` the kubelet gives under each driver.

Debian's docker is called by its full path: another docker client may be first on PATH.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import CGROUP_ROOT, enable_controllers, new_sandbox_path, remove_cgroup_tree
from systemd_host import SystemdHost

BUSYBOX = Path("/bin/busybox")
IMAGE = "localhost/nodeagent/busybox:test"
PAUSE_IMAGE = "localhost/nodeagent/pause:test"
DOCKER = "/usr/bin/docker"
PODMAN = "/usr/bin/podman"
CTR = "/usr/bin/ctr"
APPLETS = ("sh", "sleep", "cat", "dd", "head", "true", "echo", "ls", "yes", "env", "test")
START_TIMEOUT_S = float(os.environ.get("NODEAGENT_RUNTIME_START_TIMEOUT", "300"))
COMMAND_TIMEOUT_S = 180.0  # generous: Go binaries start slowly under TCG on a busy host
SHARED_DIR = Path("/srv/nodeagent-runtimes")  # the VM and the test systemd both see it
DAEMONS = ("containerd", "dockerd", "podman-api")


class RuntimeError_(AssertionError):
    """A runtime failed to start or to answer: one line of reason, then its log's tail."""


# -- the image --------------------------------------------------------------------------------


def rootfs_tar() -> bytes:
    """A one-layer rootfs: busybox-static and the applets the tests use, as a tar."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:

        def add(name: str, kind: bytes = tarfile.DIRTYPE, data: bytes = b"", **kw: Any) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = kind, kw.pop("mode", 0o755), 0
            for k, v in kw.items():
                setattr(info, k, v)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "run", "var"):
            add(d, mode=0o1777 if d == "tmp" else 0o755)
        add("bin/busybox", tarfile.REGTYPE, BUSYBOX.read_bytes())
        for applet in APPLETS:
            add(f"bin/{applet}", tarfile.SYMTYPE, linkname="busybox", mode=0o777)
        add("etc/passwd", tarfile.REGTYPE, b"root:x:0:0:root:/:/bin/sh\n", mode=0o644)
        add("etc/group", tarfile.REGTYPE, b"root:x:0:\n", mode=0o644)
    return out.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes, media: str) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media, "digest": digest, "size": len(data)}


def oci_archive(layer: bytes, images: Mapping[str, list[str]]) -> bytes:
    """An OCI image layout as a tar, one image per name (the same layer, its own command),
    named by the ``io.containerd.image.name`` annotation that ``ctr images import`` reads."""
    blobs: dict[str, bytes] = {}
    layer_desc = _blob(
        blobs, gzip.compress(layer, mtime=0), "application/vnd.oci.image.layer.v1.tar+gzip"
    )
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    manifests = []
    for name, cmd in images.items():
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": cmd, "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
        config_desc = _blob(
            blobs, json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"
        )
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_desc,
            "layers": [layer_desc],
        }
        desc = _blob(
            blobs, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json"
        )
        desc["annotations"] = {
            "io.containerd.image.name": name,
            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
        }
        manifests.append(desc)
    index = {"schemaVersion": 2, "manifests": manifests}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        files = {
            "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
            "index.json": json.dumps(index).encode(),
            **{f"blobs/sha256/{d.split(':', 1)[1]}": b for d, b in blobs.items()},
        }
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


# -- where each driver's runtimes run ----------------------------------------------------------


class Place:
    """Where a runtime set runs: its commands, its files, its long-running daemons."""

    driver: str

    def run(
        self, *argv: str, check: bool = True, timeout: float = COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None, input: bytes | None = None,
    ) -> subprocess.CompletedProcess[bytes]:  # fmt: skip
        raise NotImplementedError

    def file(self, inside: str) -> Path:
        """A file of the runtimes' mount namespace, seen from the VM."""
        raise NotImplementedError

    def daemon(self, name: str, argv: list[str], env: Mapping[str, str]) -> None:
        raise NotImplementedError

    def stop_daemon(self, name: str) -> None:
        raise NotImplementedError

    def alive(self, name: str) -> bool:
        raise NotImplementedError

    def log_tail(self, name: str) -> str:
        raise NotImplementedError

    def close(self) -> None:
        """Stop every daemon (the caller removed the containers first)."""


def _checked(
    argv: list[str], done: subprocess.CompletedProcess[bytes], check: bool
) -> subprocess.CompletedProcess[bytes]:
    if check and done.returncode != 0:
        output = (done.stdout + done.stderr).decode(errors="replace").strip()
        raise RuntimeError_(f"{' '.join(argv)!r} exited {done.returncode}: {output[-2000:]}")
    return done


class InVm(Place):
    """cgroupfs driver: daemons are processes of the VM, in a cgroup of their own."""

    driver = "cgroupfs"

    def __init__(self) -> None:
        enable_controllers(CGROUP_ROOT)
        self.cgroup = new_sandbox_path()
        self.logs = Path("/run/nodeagent-runtimes/logs")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def run(
        self, *argv: str, check: bool = True, timeout: float = COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None, input: bytes | None = None,
    ) -> subprocess.CompletedProcess[bytes]:  # fmt: skip
        full = {**os.environ, **(env or {})}
        try:
            done = subprocess.run(
                list(argv), capture_output=True, timeout=timeout, env=full, input=input,
                check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError_(f"{' '.join(argv)!r} did not finish in {timeout:.0f} s") from exc
        return _checked(list(argv), done, check)

    def file(self, inside: str) -> Path:
        return Path(inside)

    def daemon(self, name: str, argv: list[str], env: Mapping[str, str]) -> None:
        enter = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
        with (self.logs / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                ["sh", "-c", enter, str(self.cgroup), *argv],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env={**os.environ, **env},
                start_new_session=True,
            )  # fmt: skip

    def stop_daemon(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def log_tail(self, name: str) -> str:
        try:
            return "\n".join(
                (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-20:]
            )
        except OSError as exc:
            return f"(no log: {exc})"

    def close(self) -> None:
        for name in reversed(list(self.procs)):
            self.stop_daemon(name)
        remove_cgroup_tree(self.cgroup)


class InSystemd(Place):
    """systemd driver: daemons are units of the test systemd; commands run in its namespaces."""

    driver = "systemd"

    def __init__(self, host: SystemdHost) -> None:
        self.host = host
        self.units: list[str] = []

    def run(
        self, *argv: str, check: bool = True, timeout: float = COMMAND_TIMEOUT_S,
        env: Mapping[str, str] | None = None, input: bytes | None = None,
    ) -> subprocess.CompletedProcess[bytes]:  # fmt: skip
        command = [*self.host._nsenter, "env", *[f"{k}={v}" for k, v in (env or {}).items()], *argv]
        try:
            done = subprocess.run(
                command, capture_output=True, timeout=timeout, input=input, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError_(f"{' '.join(argv)!r} did not finish in {timeout:.0f} s") from exc
        return _checked(list(argv), done, check)

    def file(self, inside: str) -> Path:
        return Path(self.host.path(inside))

    def daemon(self, name: str, argv: list[str], env: Mapping[str, str]) -> None:
        unit = f"{name}.service"
        environment = "".join(f"Environment={k}={v}\n" for k, v in env.items())
        text = (
            f"[Unit]\nDescription=nodeagent test {name}\n\n[Service]\n"
            f"ExecStart={' '.join(argv)}\n{environment}"
            "Delegate=yes\nKillMode=process\nRestart=no\nLimitNOFILE=1048576\n"
        )
        self.file(f"/etc/systemd/system/{unit}").write_text(text)
        self.host.systemctl("daemon-reload")
        self.host.systemctl("start", unit)
        self.units.append(unit)

    def stop_daemon(self, name: str) -> None:
        self.host.systemctl("stop", f"{name}.service", check=False)

    def alive(self, name: str) -> bool:
        done = self.host.systemctl("is-active", f"{name}.service", check=False)
        return done.stdout.strip() in {"active", "activating"}

    def log_tail(self, name: str) -> str:
        done = self.host.run(
            "journalctl", "--no-pager", "-u", f"{name}.service", "-n", "20", check=False
        )
        return done.stdout

    def close(self) -> None:
        for unit in reversed(self.units):
            self.host.systemctl("stop", unit, check=False)
        # The pods' slices outlive their containers (systemd keeps a started slice): left, a
        # later test's agent finds an empty pod and asks a containerd that is gone about it.
        self.host.systemctl("stop", "kubepods.slice", "machine.slice", check=False)


# -- the runtimes -------------------------------------------------------------------------------


@dataclass
class Paths:
    """Sockets (reachable from the VM) and state directories (in the runtimes' namespace)."""

    state: str
    containerd: str
    docker: str
    podman: str

    @classmethod
    def for_driver(cls, driver: str) -> Paths:
        if driver == "cgroupfs":
            return cls(
                state="/run/nodeagent-runtimes/cgroupfs",
                containerd="/run/containerd/containerd.sock",
                docker="/run/docker.sock",
                podman="/run/podman/podman.sock",
            )
        shared = SHARED_DIR / driver
        return cls(
            state=f"/run/nodeagent-runtimes/{driver}",
            containerd=str(shared / "containerd.sock"),
            docker=str(shared / "docker.sock"),
            podman=str(shared / "podman.sock"),
        )


CONTAINERD_CONFIG = """\
version = 2
root = "{state}/containerd/root"
state = "{state}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{socket}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  enable_selinux = false
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = {systemd}
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{state}/cni"
"""

CONTAINERS_CONF = """\
[containers]
cgroupns = "private"
netns = "none"
log_driver = "k8s-file"

[engine]
cgroup_manager = "{manager}"
events_logger = "file"
events_logfile_path = "{state}/podman/events.log"
tmp_dir = "{state}/podman/tmp"
runtime = "crun"
"""

STORAGE_CONF = """\
[storage]
driver = "vfs"
runroot = "{state}/podman/runroot"
graphroot = "{state}/podman/root"
"""


@dataclass
class Container:
    """One container a test started, with its cgroup as the VM sees it."""

    runtime: str
    id: str
    name: str
    cgroup: Path


@dataclass
class Runtimes:
    """One driver's containerd (with CRI), dockerd and podman (with its API service)."""

    place: Place
    paths: Paths
    sandbox_root: Path
    """The cgroup root as the runtimes see it, in the VM: /sys/fs/cgroup, or systemd's."""
    started: dict[str, float] = field(default_factory=dict)
    """Seconds each daemon took to answer."""
    containers: list[Container] = field(default_factory=list)
    pods: list[str] = field(default_factory=list)
    daemons: tuple[str, ...] = DAEMONS
    """Which of DAEMONS to start: the image tier needs containerd's CRI alone."""
    _launch: dict[str, tuple[list[str], Mapping[str, str], str]] = field(default_factory=dict)

    @property
    def driver(self) -> str:
        return self.place.driver

    @property
    def podman_env(self) -> dict[str, str]:
        state = self.paths.state
        return {
            "CONTAINERS_CONF": f"{state}/podman/containers.conf",
            "CONTAINERS_STORAGE_CONF": f"{state}/podman/storage.conf",
            "CONTAINERS_REGISTRIES_CONF": f"{state}/podman/registries.conf",
            "TMPDIR": f"{state}/podman/tmp",
        }

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """containerd, dockerd and podman's API service (those of them `daemons` names),
        with the images imported."""
        state, place = self.paths.state, self.place
        for d in ("containerd", "cni", "docker", "podman/tmp"):
            place.file(f"{state}/{d}").mkdir(parents=True, exist_ok=True)
        for socket in (self.paths.containerd, self.paths.docker, self.paths.podman):
            Path(socket).parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                Path(socket).unlink()
        systemd = "true" if self.driver == "systemd" else "false"
        config = CONTAINERD_CONFIG.format(
            state=state, socket=self.paths.containerd, pause=PAUSE_IMAGE, systemd=systemd
        )
        place.file(f"{state}/containerd/config.toml").write_text(config)
        containerd = ["/usr/bin/containerd", "--config", f"{state}/containerd/config.toml"]
        self._start("containerd", containerd, {}, self.paths.containerd)
        if "dockerd" in self.daemons:
            self._start_dockerd()
        if "podman-api" in self.daemons:
            self._start_podman_api()
        self._import_images()

    def _start_dockerd(self) -> None:
        state, place = self.paths.state, self.place
        place.file(f"{state}/docker/daemon.json").write_text("{}")
        dockerd = [
            "/usr/sbin/dockerd", "--config-file", f"{state}/docker/daemon.json",
            "--data-root", f"{state}/docker/data", "--exec-root", f"{state}/docker/exec",
            "--pidfile", f"{state}/docker/docker.pid", "-H", f"unix://{self.paths.docker}",
            "--containerd", self.paths.containerd, "--bridge", "none", "--iptables=false",
            "--ip6tables=false", "--ip-masq=false", "--storage-driver", "vfs", "--live-restore",
            "--exec-opt", f"native.cgroupdriver={self.driver}", "--log-level", "warn",
        ]  # fmt: skip
        self._start("dockerd", dockerd, {}, self.paths.docker)

    def _start_podman_api(self) -> None:
        state, place = self.paths.state, self.place
        manager = self.driver
        place.file(f"{state}/podman/containers.conf").write_text(
            CONTAINERS_CONF.format(manager=manager, state=state)
        )
        place.file(f"{state}/podman/storage.conf").write_text(STORAGE_CONF.format(state=state))
        place.file(f"{state}/podman/registries.conf").write_text(
            'unqualified-search-registries = []\nshort-name-mode = "disabled"\n'
        )
        service = [PODMAN, "system", "service", "--time=0", f"unix://{self.paths.podman}"]
        self._start("podman-api", service, self.podman_env, self.paths.podman)

    def stop_daemon(self, name: str) -> None:
        """Stop one daemon (dockerd keeps its containers: --live-restore)."""
        self.place.stop_daemon(name)
        self.place.file(self._launch[name][2]).unlink(missing_ok=True)

    def start_daemon(self, name: str) -> None:
        """Start a daemon stopped by stop_daemon again, as it was started."""
        self._start(name, *self._launch[name])

    def _start(self, name: str, argv: list[str], env: Mapping[str, str], socket: str) -> None:
        self._launch[name] = (argv, env, socket)
        t0 = time.monotonic()
        self.place.daemon(name, argv, env)
        deadline = t0 + START_TIMEOUT_S
        while not Path(socket).exists():
            if not self.place.alive(name):
                raise RuntimeError_(
                    f"{name} ({self.driver}) exited before it made {socket}:\n"
                    + self.place.log_tail(name)
                )
            if time.monotonic() > deadline:
                raise RuntimeError_(
                    f"{name} ({self.driver}) made no {socket} in {START_TIMEOUT_S:.0f} s:\n"
                    + self.place.log_tail(name)
                )
            time.sleep(0.1)
        self.started[name] = time.monotonic() - t0

    def _import_images(self) -> None:
        layer = rootfs_tar()
        tar = Path(self.place.file(f"{self.paths.state}/rootfs.tar"))
        tar.write_bytes(layer)
        inside_tar = f"{self.paths.state}/rootfs.tar"
        if "dockerd" in self.daemons:
            self.docker("import", "--change", 'CMD ["sleep", "3600"]', "--change",
                        "ENV PATH=/bin", inside_tar, IMAGE)  # fmt: skip
        if "podman-api" in self.daemons:
            self.podman("import", "--change", 'CMD ["sleep", "3600"]', "--change",
                        "ENV PATH=/bin", inside_tar, IMAGE)  # fmt: skip
        archive = oci_archive(
            layer, {IMAGE: ["sleep", "3600"], PAUSE_IMAGE: ["sleep", "2147483647"]}
        )
        self.place.file(f"{self.paths.state}/images.oci.tar").write_bytes(archive)
        self.ctr("-n", "k8s.io", "images", "import", "--snapshotter", "native",
                 f"{self.paths.state}/images.oci.tar")  # fmt: skip

    def stop(self) -> None:
        """Remove every container and pod the tests left, stop the daemons, remove their
        cgroups."""
        problems = []
        for step in (self.remove_pods, self.remove_containers):
            try:
                step()
            except AssertionError as exc:
                problems.append(str(exc))
        self.place.close()
        for top in ("docker", "libpod_parent", "kubepods", "kubepods.slice", "machine.slice"):
            cgroup = self.sandbox_root / top
            if self.driver == "cgroupfs" and cgroup.exists():
                remove_cgroup_tree(cgroup)
            elif cgroup.exists():
                problems.append(f"{cgroup} is left after its slice was stopped")
        if problems:
            raise RuntimeError_("; ".join(problems))

    # -- clients ----------------------------------------------------------------------------------

    def docker(self, *args: str, check: bool = True) -> str:
        argv = [DOCKER, "-H", f"unix://{self.paths.docker}", *args]
        return self.place.run(*argv, check=check).stdout.decode().strip()

    def podman(self, *args: str, check: bool = True) -> str:
        return (
            self.place.run(PODMAN, *args, check=check, env=self.podman_env).stdout.decode().strip()
        )

    def ctr(self, *args: str, check: bool = True) -> str:
        return (
            self.place.run(CTR, "--address", self.paths.containerd, *args, check=check)
            .stdout.decode()
            .strip()
        )

    def cri(self) -> Cri:
        return Cri(self.paths.containerd)

    # -- containers ------------------------------------------------------------------------------

    def cgroup_of(self, runtime: str, cid: str, pod: str | None = None) -> Path:
        root = self.sandbox_root
        if runtime == "docker":
            rel = (
                f"docker/{cid}" if self.driver == "cgroupfs" else f"system.slice/docker-{cid}.scope"
            )
        elif runtime == "podman":
            rel = (
                f"libpod_parent/libpod-{cid}"
                if self.driver == "cgroupfs"
                else f"machine.slice/libpod-{cid}.scope"
            )
        else:
            assert pod is not None
            rel = (
                f"{pod}/{cid}" if self.driver == "cgroupfs" else f"{pod}/cri-containerd-{cid}.scope"
            )
        return root / rel

    def run_docker(self, name: str, *options: str, command: tuple[str, ...] = ()) -> Container:
        # the VM's kernel has AppArmor on, and Debian's docker.io leaves apparmor_parser out
        cid = self.docker(
            "run", "-d", "--name", name, "--network", "none",
            "--security-opt", "apparmor=unconfined", *options, IMAGE, *command,
        )  # fmt: skip
        container = Container("docker", cid, name, self.cgroup_of("docker", cid))
        self.containers.append(container)
        return container

    def run_podman(self, name: str, *options: str, command: tuple[str, ...] = ()) -> Container:
        cid = self.podman(
            "run", "-d", "--name", name, "--network", "none", *options, IMAGE, *command
        )
        container = Container("podman", cid, name, self.cgroup_of("podman", cid))
        self.containers.append(container)
        return container

    def exec(self, c: Container, *argv: str) -> int:
        """Run argv inside the container (its cgroup); its exit status."""
        if c.runtime == "docker":
            cli = [DOCKER, "-H", f"unix://{self.paths.docker}", "exec", c.id]
            return self.place.run(*cli, *argv, check=False).returncode
        if c.runtime == "podman":
            cli = [PODMAN, "exec", c.id]
            return self.place.run(*cli, *argv, check=False, env=self.podman_env).returncode
        cri = self.cri()
        try:
            return cri.exec_sync(c.id, list(argv))
        finally:
            cri.close()

    def remove(self, c: Container) -> None:
        if c.runtime == "docker":
            self.docker("rm", "-f", c.id, check=False)
        elif c.runtime == "podman":
            self.podman("rm", "-f", "-t", "0", c.id, check=False)
        if c in self.containers:
            self.containers.remove(c)

    def remove_containers(self) -> None:
        for c in reversed(self.containers):
            if c.runtime == "docker":
                self.docker("rm", "-f", c.id, check=False)
            elif c.runtime == "podman":
                self.podman("rm", "-f", "-t", "0", c.id, check=False)
        self.containers.clear()

    def remove_pods(self) -> None:
        if not self.pods:
            return
        cri = self.cri()
        try:
            for sandbox in reversed(self.pods):
                cri.remove_pod(sandbox)
        finally:
            cri.close()
        self.pods.clear()

    def remove_pod(self, pod: Pod) -> None:
        cri = self.cri()
        try:
            cri.remove_pod(pod.sandbox_id)
        finally:
            cri.close()
        self.pods.remove(pod.sandbox_id)

    def pod_parent(self, uid: str) -> str:
        """The cgroup_parent the kubelet gives a burstable pod under this driver."""
        if self.driver == "cgroupfs":
            return f"/kubepods/burstable/pod{uid}"
        return f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"

    def pod_cgroup(self, uid: str) -> Path:
        if self.driver == "cgroupfs":
            return self.sandbox_root / f"kubepods/burstable/pod{uid}"
        escaped = uid.replace("-", "_")
        return self.sandbox_root / (
            f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{escaped}.slice"
        )

    def run_pod(
        self, namespace: str, name: str, labels: Mapping[str, str],
        annotations: Mapping[str, str], containers: Mapping[str, tuple[str, ...]],
        cpuset: str | None = None,
    ) -> Pod:  # fmt: skip
        """A pod as the kubelet makes it, through the CRI; each container runs its command."""
        uid = str(uuid.uuid4())
        cri = self.cri()
        try:
            pod = cri.run_pod(
                namespace, name, uid, labels, annotations, self.pod_parent(uid), containers,
                cpuset=cpuset,
            )  # fmt: skip
        finally:
            cri.close()
        self.pods.append(pod.sandbox_id)
        pod.cgroup = self.pod_cgroup(uid)
        pod.containers = {
            n: Container(
                "containerd",
                cid,
                n,
                self.cgroup_of("containerd", cid, str(pod.cgroup.relative_to(self.sandbox_root))),
            )
            for n, cid in pod.container_ids.items()
        }
        return pod


# -- CRI, as the kubelet speaks it --------------------------------------------------------------


@dataclass
class Pod:
    uid: str
    sandbox_id: str
    container_ids: dict[str, str]
    cgroup: Path = Path()
    containers: dict[str, Container] = field(default_factory=dict)


class Cri:
    """The few CRI calls the kubelet makes to start and remove a pod (runtime.v1)."""

    def __init__(self, socket: str) -> None:
        import grpc
        from cri_api.v1 import api_pb2, api_pb2_grpc

        self.pb = api_pb2
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.stub = api_pb2_grpc.RuntimeServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def ready(self) -> bool:
        """Whether the CRI serves pods: after a start containerd answers on its socket (ctr)
        before its CRI plugin is up ("server is not initialized yet")."""
        import grpc

        try:
            answer = self.stub.Status(self.pb.StatusRequest(), timeout=COMMAND_TIMEOUT_S)
        except grpc.RpcError:
            return False
        return any(c.type == "RuntimeReady" and c.status for c in answer.status.conditions)

    def run_pod(
        self, namespace: str, name: str, uid: str, labels: Mapping[str, str],
        annotations: Mapping[str, str], parent: str, containers: Mapping[str, tuple[str, ...]],
        cpuset: str | None = None,
    ) -> Pod:  # fmt: skip
        pb = self.pb
        kubelet_labels = {
            **labels,
            "io.kubernetes.pod.name": name,
            "io.kubernetes.pod.namespace": namespace,
            "io.kubernetes.pod.uid": uid,
        }
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
            # no hostname: with the node's network there is no UTS namespace to set it in
            labels=kubelet_labels,
            annotations=dict(annotations),
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=parent,
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.POD, ipc=pb.POD)
                ),
            ),
        )
        timeout = COMMAND_TIMEOUT_S
        sandbox = self.stub.RunPodSandbox(
            pb.RunPodSandboxRequest(config=config), timeout=timeout
        ).pod_sandbox_id
        ids = {}
        for cname, command in containers.items():
            resources = pb.LinuxContainerResources(cpuset_cpus=cpuset or "")
            cconfig = pb.ContainerConfig(
                metadata=pb.ContainerMetadata(name=cname, attempt=0),
                image=pb.ImageSpec(image=IMAGE),
                command=list(command),
                labels={
                    "io.kubernetes.container.name": cname,
                    "io.kubernetes.pod.name": name,
                    "io.kubernetes.pod.namespace": namespace,
                    "io.kubernetes.pod.uid": uid,
                },
                annotations={"io.kubernetes.container.restartCount": "0"},
                linux=pb.LinuxContainerConfig(resources=resources),
            )
            cid = self.stub.CreateContainer(
                pb.CreateContainerRequest(
                    pod_sandbox_id=sandbox, config=cconfig, sandbox_config=config
                ),
                timeout=timeout,
            ).container_id
            self.stub.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=timeout)
            ids[cname] = cid
        return Pod(uid, sandbox, ids)

    def exec_sync(self, container_id: str, cmd: list[str]) -> int:
        pb = self.pb
        request = pb.ExecSyncRequest(container_id=container_id, cmd=cmd, timeout=120)
        return int(self.stub.ExecSync(request, timeout=COMMAND_TIMEOUT_S).exit_code)

    def remove_pod(self, sandbox: str) -> None:
        pb, timeout = self.pb, COMMAND_TIMEOUT_S
        self.stub.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sandbox), timeout=timeout)
        self.stub.RemovePodSandbox(
            pb.RemovePodSandboxRequest(pod_sandbox_id=sandbox), timeout=timeout
        )


@contextlib.contextmanager
def started(
    place: Place, sandbox_root: Path, daemons: tuple[str, ...] = DAEMONS
) -> Iterator[Runtimes]:
    """One driver's runtimes (`daemons` of them: containerd always), started, images
    imported; stopped and cleaned after."""
    runtimes = Runtimes(place, Paths.for_driver(place.driver), sandbox_root, daemons=daemons)
    try:
        runtimes.start()
        yield runtimes
    finally:
        runtimes.stop()


def remove_shared_dir() -> None:
    shutil.rmtree(SHARED_DIR, ignore_errors=True)
