"""Which GPUs a container runtime gave a container, read from the runtime's own answer: pure.

Docker (moby) keeps `docker run --gpus` in the container's inspect answer
(`GET /containers/{id}/json`), `HostConfig.DeviceRequests`: one entry per `--gpus`, with
`Driver`, `Count`, `DeviceIDs`, `Capabilities` and `Options`. moby gives an entry to its NVIDIA
driver when `Driver` is `nvidia`, or, with no `Driver`, when one of the `Capabilities`' inner
lists is all NVIDIA capabilities (`--gpus` writes `[["gpu"]]`); the driver then sets the
container's `NVIDIA_VISIBLE_DEVICES` (moby's daemon/nvidia_linux.go, setNvidiaGPUs): the
`DeviceIDs` (indices, UUIDs, MIG ids) when there are some, `Count: -1` all GPUs, `Count: N`
indices 0 to N-1 (countToDevices), `Count: 0` none (`void`).

Before `--gpus` (and still, where the NVIDIA runtime is configured): a container under the
`nvidia` runtime (`HostConfig.Runtime`) gets what its environment's `NVIDIA_VISIBLE_DEVICES`
says (`Config.Env`, the image's merged with the container's): `all`, a list of ids, or none
(`none`, `void`, empty). Unset in a legacy CUDA image (`CUDA_VERSION` set and
`NVIDIA_REQUIRE_CUDA` not) it is all GPUs, as nvidia-container-toolkit reads it.

Every answer is bounded as nodeagent.meta bounds the others: a malformed one is refused
(`BadAnswer`) for that container, never half read.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass

from nodeagent.gpu.model import GpuState
from nodeagent.meta import BadAnswer, name

MAX_REQUESTS = 64
"""Device requests in one answer (`--gpus` can be given once; other drivers add a few)."""
MAX_IDS = 1024
"""GPU ids (or a Count) in one request, and capabilities in one."""
MAX_ENV = 16384
"""Entries of a container's environment."""
NVIDIA_CAPABILITIES = frozenset(
    {"gpu", "nvidia", "compute", "compat32", "graphics", "utility", "video", "display"}
)
"""moby's NVIDIA driver's capability set: a request with no Driver is the driver's when one
of its Capabilities' inner lists is within it."""
VISIBLE = "NVIDIA_VISIBLE_DEVICES"
REPLICA = "::"
"""What NVIDIA's device plugin puts between a shared GPU's id and its replica's number."""


@dataclass(frozen=True, slots=True)
class GpuGrant:
    """The GPUs a runtime gave one container, as it named them."""

    every: bool = False
    """All the node's GPUs (`--gpus all`, `NVIDIA_VISIBLE_DEVICES=all`)."""
    ids: tuple[str, ...] = ()
    """GPUs by index (`0`), UUID (`GPU-...`), MIG instance (`0:1`, `MIG-...`), in order."""
    via: str = ""
    """How they were given: `--gpus` (DeviceRequests), `the nvidia runtime`, or both."""

    @property
    def none(self) -> bool:
        return not self.every and not self.ids


NO_GPUS = GpuGrant()


def visible_devices(value: str) -> tuple[bool, tuple[str, ...]]:
    """NVIDIA_VISIBLE_DEVICES read as nvidia-container-toolkit reads it: (all, ids)."""
    value = value.strip()
    if value == "all":
        return True, ()
    if value in ("", "none", "void"):
        return False, ()
    return False, tuple(i.strip() for i in value.split(",") if i.strip())


def _mapping(value: object, what: str) -> Mapping[str, object]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadAnswer(f"{what} is not a mapping")
    return value


def _list(value: object, what: str, limit: int) -> list[object]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadAnswer(f"{what} is not a list")
    if len(value) > limit:
        raise BadAnswer(f"{what} has {len(value)} entries, more than {limit}")
    return value


def _names(value: object, what: str) -> list[str]:
    return [name(v, what) for v in _list(value, what, MAX_IDS)]


def _nvidia(request: Mapping[str, object], at: str) -> bool:
    """Whether moby hands this request to its NVIDIA driver."""
    driver = request.get("Driver")
    driver = "" if driver is None else name(driver, f"{at}.Driver")
    capabilities = [
        _names(inner, f"{at}.Capabilities[]")
        for inner in _list(request.get("Capabilities"), f"{at}.Capabilities", MAX_IDS)
    ]
    if driver:
        return driver == "nvidia"
    return any(inner and NVIDIA_CAPABILITIES.issuperset(inner) for inner in capabilities)


def _count(value: object, at: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadAnswer(f"{at}.Count is not an integer")
    if value > MAX_IDS:
        raise BadAnswer(f"{at}.Count is {value}, more than {MAX_IDS}")
    return value


def _requested(host: Mapping[str, object]) -> tuple[bool, list[str]] | None:
    """What HostConfig.DeviceRequests give the NVIDIA driver; None: nothing asked of it."""
    every, ids, asked = False, list[str](), False
    requests = _list(host.get("DeviceRequests"), "HostConfig.DeviceRequests", MAX_REQUESTS)
    for n, raw in enumerate(requests):
        at = f"HostConfig.DeviceRequests[{n}]"
        request = _mapping(raw, at)
        count = _count(request.get("Count"), at)
        named = _names(request.get("DeviceIDs"), f"{at}.DeviceIDs")
        if not _nvidia(request, at):
            continue
        asked = True
        if named:
            ids += named
        elif count < 0:
            every = True
        else:
            ids += [str(i) for i in range(count)]
    return (every, ids) if asked else None


def _environment(config: Mapping[str, object]) -> tuple[bool, list[str]]:
    """What the nvidia runtime gives a container with this Config (its Env)."""
    env: dict[str, str] = {}
    for entry in _list(config.get("Env"), "Config.Env", MAX_ENV):
        if not isinstance(entry, str):
            raise BadAnswer("an entry of Config.Env is not a string")
        key, _, value = entry.partition("=")
        if key in (VISIBLE, "CUDA_VERSION", "NVIDIA_REQUIRE_CUDA"):
            env[key] = name(value, f"Config.Env's {key}")
    if VISIBLE not in env:
        legacy = bool(env.get("CUDA_VERSION")) and not env.get("NVIDIA_REQUIRE_CUDA")
        return legacy, []
    every, ids = visible_devices(env[VISIBLE])
    if len(ids) > MAX_IDS:
        raise BadAnswer(f"{VISIBLE} names {len(ids)} GPUs, more than {MAX_IDS}")
    return every, list(ids)


def docker_gpus(answer: object) -> GpuGrant:
    """The GPUs a Docker container was given, from dockerd's inspect answer (parsed JSON).
    Raises BadAnswer for an answer that is not what moby's API says."""
    inspect = _mapping(answer, "the inspect answer")
    host = _mapping(inspect.get("HostConfig"), "HostConfig")
    every, ids, via = False, list[str](), list[str]()
    requested = _requested(host)
    if requested is not None:
        every, ids = requested
        via.append("--gpus")
    runtime = host.get("Runtime")
    if runtime is not None and name(runtime, "HostConfig.Runtime") == "nvidia":
        more, named = _environment(_mapping(inspect.get("Config"), "Config"))
        every, ids = every or more, ids + named
        via.append("the nvidia runtime")
    if not every and not ids:
        return NO_GPUS
    unique = tuple(dict.fromkeys(ids))
    return GpuGrant(every, () if every else unique, " and ".join(via))


def uuid_indices(gpus: GpuState) -> dict[str, int]:
    """Each GPU's UUID and each MIG instance's, with the index of the GPU it is or is on."""
    index = {d.uuid: d.index for d in gpus.devices}
    index |= {m.uuid: d.index for d in gpus.devices for m in d.mig_devices}
    return index


def device_uuid(device_id: str, gpus: GpuState, known: Container[str]) -> str | None:
    """The UUID of the GPU or MIG instance `device_id` names: an index (`0`), a MIG instance
    on one (`0:1`), a UUID (`GPU-...`, `MIG-...`), or a device plugin's replica of either
    (`GPU-...::3`); None for one this node does not have. `known`: `uuid_indices(gpus)`."""
    base = device_id.split(REPLICA, 1)[0]
    if base.isdecimal():
        return next((d.uuid for d in gpus.devices if d.index == int(base)), None)
    gpu, colon, mig = base.partition(":")
    if colon and gpu.isdecimal() and mig.isdecimal():
        parents = [d for d in gpus.devices if d.index == int(gpu)]
        found = [m for d in parents for m in d.mig_devices if m.index == int(mig)]
        return found[0].uuid if found else None
    return base if base in known else None


def granted(grant: GpuGrant, gpus: GpuState) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the UUIDs of the GPUs or MIG instances `grant` names on this node, sorted; the ids
    it names that are no GPU of this node)."""
    if grant.every:
        return tuple(sorted(d.uuid for d in gpus.devices)), ()
    known = uuid_indices(gpus)
    named = {i: device_uuid(i, gpus, known) for i in grant.ids}
    uuids = tuple(sorted({u for u in named.values() if u is not None}))
    return uuids, tuple(i for i, u in named.items() if u is None)
