"""The gpus commands: what GPUs this node has, and which a request would get now."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import click

from nodeagent.cli.common import json_option, socket_option
from nodeagent.cli.output import document, echo_json, item_list, renamed, terminal_width
from nodeagent.errors import NodeagentError
from nodeagent.tables import age, size, table, wrap

if TYPE_CHECKING:  # the commands import the API's answers when they run
    from nodeagent.api.answers import GpuList, Placed, Placement, Reservation, Waiting
    from nodeagent.gpu.backend import GpuBackend
    from nodeagent.gpualloc.placing import Question

F = TypeVar("F", bound=Callable[..., Any])


def simulate_option(f: F) -> F:
    return click.option(
        "--simulate",
        metavar="FILE",
        help="Use the simulated node described in FILE (see config/gpus/) instead of NVML; "
        "default: the file NODEAGENT_GPU_SIM names, if set.",
    )(f)


def _open(simulate: str | None) -> GpuBackend:
    from nodeagent.gpu.choice import open_backend

    return open_backend(simulate)


def _bytes(n: int | None) -> str:
    return "-" if n is None else size(str(n)) or "-"


def _num(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:g}{unit}"


# The --json documents (see cli/output.py): the report's, the daemon's and the placer's
# dicts with units in their keys. Only here: the daemon's API keeps its own names.
_GPU_UNITS = {
    "memory_total": "memory_total_bytes",
    "memory_used": "memory_used_bytes",
    "utilization": "utilization_percent",
    "temperature_c": "temperature_celsius",
    "power_draw_w": "power_draw_watts",
    "power_limit_w": "power_limit_watts",
    "power_min_w": "power_min_watts",
    "power_max_w": "power_max_watts",
    "power_default_w": "power_default_watts",
}
_LISTED_UNITS = {  # a GPU's lists, by key: the units of their items' keys
    "mig_devices": {"memory_total": "memory_total_bytes"},
    "processes": {"used_memory": "used_memory_bytes"},
    "assigned": {"shared_memory": "shared_memory_bytes"},  # the daemon's view adds it
}
# A placement's score is in points (the pairs' link scores plus the NUMA bonus): `score`
# and `pair_score` say so already, the other scores get `_score`, and the score's share of
# the best possible on an empty node is a `_fraction`.
_SCORE_UNITS = {
    "fraction": "score_fraction",
    "numa_bonus": "numa_bonus_score",
    "best_possible": "best_possible_score",
}
_RESERVATION_UNITS = {**_SCORE_UNITS, "until": "until_timestamp_seconds"}
_REQUEST_UNITS = {"memory": "memory_bytes"}


def _gpu_document(gpu: Mapping[str, Any]) -> dict[str, Any]:
    out = renamed(gpu, _GPU_UNITS)
    for key, names in _LISTED_UNITS.items():
        if key in out:
            out[key] = [renamed(item, names) for item in out[key]]
    return out


def gpu_list_document(data: GpuList) -> dict[str, Any]:
    """`gpus --json`: kind GpuList; `source`, `simulated`, `reason` (why there are none),
    with a daemon `queue` (the requests waiting), and the GPUs as `items`."""
    plain = data.model_dump(by_alias=True)
    extra = {k: v for k, v in plain.items() if k != "gpus"}
    return item_list("GpuList", (_gpu_document(g) for g in plain["gpus"]), **extra)


def reservation_document(got: Reservation) -> dict[str, Any]:
    """`gpus reserve --json` (and --format json): kind GpuReservation."""
    return document("GpuReservation", renamed(got.model_dump(by_alias=True), _RESERVATION_UNITS))


def placement_document(data: Placement) -> dict[str, Any]:
    """`gpus place --json`: kind GpuPlacement; when nothing fits, `placed` false and the
    reason, no set."""
    body = renamed(data.model_dump(by_alias=True), _SCORE_UNITS)
    if "request" in body:
        body["request"] = renamed(body["request"], _REQUEST_UNITS)
    return document("GpuPlacement", body)


@click.group("gpus", invoke_without_command=True)
@simulate_option
@socket_option
@json_option
@click.pass_context
def gpus(ctx: click.Context, simulate: str | None, socket: str, as_json: bool) -> None:
    """This node's GPUs: health, utilisation, memory, power, MIG devices, and the
    compute processes on them with their cgroups.

    With a daemon running, it also shows what the daemon assigned to each GPU, the
    processes that run on GPUs their cgroup does not hold (violations), and the
    requests waiting for GPUs. Without one (or with --simulate), it reads the GPUs
    itself.

    GPUs come from NVML, or from a simulated node (a YAML file, see config/gpus/)
    named by --simulate or NODEAGENT_GPU_SIM. Everything simulated says so. A host
    without an NVIDIA driver has no GPUs, which is said in one line: CPU and memory
    management work the same without them.

    \b
      nodeagent gpus
      nodeagent gpus --simulate config/gpus/dgx-h100-nvswitch.yaml --json
      nodeagent gpus place --count 4 --busy 0,5
      nodeagent gpus reserve --name web-1 --count 1 --format docker
    """
    if ctx.invoked_subcommand is not None:
        return
    from nodeagent.api import client
    from nodeagent.api.answers import GpuList
    from nodeagent.errors import DaemonUnreachable
    from nodeagent.gpu.report import read_report

    data: GpuList | None = None
    if simulate is None:
        try:
            data = client.get_as(GpuList, socket, "/v1/gpus")
        except DaemonUnreachable:
            pass
        except NodeagentError as e:
            if "no GPUs" not in str(e):
                raise
    if data is None:
        backend = _open(simulate)
        try:
            data = GpuList.model_validate(read_report(backend))
        finally:
            backend.close()
    if as_json:
        echo_json(gpu_list_document(data))
    elif not data.gpus:
        click.echo(f"no GPUs: {data.reason}")
    else:
        click.echo(_gpus_table(data, terminal_width()))


def _gpus_table(data: GpuList, width: int | None = None) -> str:
    """The GPUs, their MIG devices, processes, violations and the queue, each table fitted
    to `width`: the model named once in the first line where every GPU is the same; UUIDs
    cut to the head that tells them apart, cgroups to their leaf."""
    gpus = data.gpus
    models = {g.name or "?" for g in gpus}
    model = f" ({models.pop()})" if len(models) == 1 else ""
    head = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}{model}, {data.source}"
    rows = [
        (
            g.index,
            g.uuid or "?",
            *(() if model else (g.name or "?",)),
            "ok" if g.healthy else f"UNHEALTHY: {g.reason}",
            _num(g.utilization, "%"),
            f"{_bytes(g.memory_used)}/{_bytes(g.memory_total)}",
            f"{_num(g.power_draw_w)}/{_num(g.power_limit_w, 'W')}",
            _num(g.temperature_c, "C"),
            _num(g.numa_node),
            g.cpus or "-",
            "?" if g.assigned is None else ", ".join(a.owner for a in g.assigned),
        )
        for g in gpus
    ]
    headers: tuple[str, ...] = ("GPU", "UUID", *(() if model else ("NAME",)), "HEALTH", "UTIL")
    headers += ("MEMORY", "POWER", "TEMP", "NUMA", "CPUS", "ASSIGNED")
    at = headers.index
    out = [
        wrap(head, width),
        table(
            headers,
            rows,
            width=width,
            cut=[(at("HEALTH"), "head"), (at("ASSIGNED"), "head"), (at("UUID"), "id")],
            drop=[at(h) for h in ("CPUS", "NAME", "TEMP", "POWER", "UUID") if h in headers],
            more="--json",
        ),
    ]
    if gpus[0].assigned is None:
        out.append(wrap("(assignments and violations: no nodeagent daemon answered)", width))
    migs = [(g.index, m) for g in gpus for m in g.mig_devices]
    if migs:
        out += [
            "",
            "MIG devices:",
            table(
                ("GPU", "MIG UUID", "PROFILE", "MEMORY", "HEALTH"),
                [
                    (
                        i,
                        m.uuid,
                        m.profile,
                        _bytes(m.memory_total),
                        "ok" if m.healthy else f"UNHEALTHY: {m.reason}",
                    )
                    for i, m in migs
                ],
                width=width,
                cut=[(4, "head"), (1, "id")],
            ),
        ]
    procs = [(g.index, p) for g in gpus for p in g.processes]
    out += ["", "compute processes:" if procs else "compute processes: none"]
    if procs:
        out.append(
            table(
                ("PID", "GPU", "DEVICE", "MEMORY", "CGROUP"),
                [
                    (p.pid, i, p.device_uuid, _bytes(p.used_memory), p.cgroup or "(exited)")
                    for i, p in procs
                ],
                width=width,
                cut=[(2, "id"), (4, "leaf")],
            )
        )
    violations = [(g.index, v) for g in gpus for v in g.violations or ()]
    if violations:
        out += ["", wrap("VIOLATIONS: processes on GPUs their cgroup does not hold:", width)]
        out.append(
            table(
                ("PID", "GPU", "DEVICE", "KIND", "CGROUP", "HOLDS"),
                [
                    (v.pid, i, v.device, v.kind, v.cgroup, v.holder or "nothing")
                    for i, v in violations
                ],
                width=width,
                cut=[(5, "head"), (2, "id"), (4, "leaf")],
            )
        )
    if data.queue:
        out += ["", "waiting for GPUs (STARTS: when the GPUs kept for the first in line are"]
        out += ["expected free):"]
        now = time.time()
        rows = [
            (q.id or "-", q.owner, q.count, q.workload_class, _starts(q, now), q.reason)
            for q in data.queue
        ]
        out.append(
            table(
                ("REQUEST", "FOR", "COUNT", "CLASS", "STARTS", "WHY"),
                rows,
                width=width,
                cut=[(5, "head"), (0, "id"), (1, "leaf")],
            )
        )
    return "\n".join(out)


def _starts(q: Waiting, now: float) -> str:
    """The head of the queue's expected start, from now; '-' for the others."""
    if not q.kept:
        return "-"
    if q.expected_start is None:
        return "unknown"
    return "in " + age(q.expected_start - now)


@gpus.command("reserve")
@click.option(
    "--name",
    required=True,
    metavar="NAME",
    help="The reservation's name (as a job name: letters, digits, '_.@+-'), unique on the node.",
)
@click.option(
    "--container",
    metavar="ID|NAME",
    help="The container the GPUs are for: its id (12 or more hex digits, or in full) or a"
    " workload name as `nodeagent workloads` shows it (a service unit, pod-<uid>). Can be"
    " named later with `gpus attach`.",
)
@click.option("--count", "-k", type=click.IntRange(min=1, max=64), default=1, show_default=True)
@click.option("--memory", metavar="SIZE", help="Free memory each GPU needs, such as 20Gi.")
@click.option("--shared", is_flag=True, help="Share GPUs with other shared holders.")
@click.option(
    "--tenant", metavar="T", help="Its tenant (default: jobs.default_tenant in the policy)."
)
@click.option(
    "--class",
    "workload_class",
    metavar="C",
    help="Its class, for power caps (default: jobs.default_class).",
)
@click.option(
    "--ttl",
    default="10m",
    show_default=True,
    metavar="DURATION",
    help="Released after this unless the container has appeared by then.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["docker", "env", "json"]),
    default="docker",
    show_default=True,
    help="docker: arguments for `docker run $(...)`; env: an env file; json: as --json.",
)
@socket_option
@json_option
def reserve_cmd(
    *,
    name: str,
    container: str | None,
    count: int,
    memory: str | None,
    shared: bool,
    tenant: str | None,
    workload_class: str | None,
    ttl: str,
    fmt: str,
    socket: str,
    as_json: bool,
) -> None:
    """Hold GPUs for a container that gets them at creation; print how to give them to it.

    The daemon places the GPUs as for a job and holds them under NAME for the container
    named by --container. Once discovery shows that container's cgroup (matched by its
    id, or by its workload name), the hold follows it and goes back when the cgroup goes;
    if it has not appeared within --ttl, the GPUs go back then. Nothing else can take the
    hold over: not the first process that shows on the GPUs, not a login session, not a
    cgroup in another user's delegated subtree. A process on the GPUs from any other
    cgroup is a violation (`nodeagent gpus`).

    Runtimes that make the container's id only when they create it: reserve, create the
    container with the GPUs, name it with `gpus attach`, then start it. Only the uid that
    made a reservation (or root) may name its container or release it.

    The docker form is made for an unquoted $(...), where the shell splits words but
    removes no quotes: `--gpus "device=A,B"` reaches docker with the double quotes that
    its CSV parser needs around a list (one GPU needs none). To type the list by hand,
    quote it as docker's documentation does: --gpus '"device=A,B"'.

    \b
      cid=$(docker create $(nodeagent gpus reserve --name web-1 --count 2) IMAGE)
      nodeagent gpus attach web-1 "$cid" && docker start "$cid"
      nodeagent gpus reserve --name infer --container infer.service --format env
      nodeagent gpus reserve --name web-1 --json
      nodeagent gpus release web-1
    """
    from nodeagent.api import client
    from nodeagent.api.answers import Reservation

    body: dict[str, Any] = {"name": name, "count": count, "shared": shared, "ttl": ttl}
    optional = {"container": container, "tenant": tenant, "class": workload_class}
    body |= {k: v for k, v in optional.items() if v is not None}
    if memory is not None:
        body["memory"] = _size(memory)
    got = client.post_as(Reservation, socket, "/v1/gpus/reservations", body)
    visible = ",".join(got.uuids)
    if as_json or fmt == "json":
        echo_json(reservation_document(got))
    elif fmt == "env":
        click.echo(
            f"CUDA_VISIBLE_DEVICES={visible}\nNVIDIA_VISIBLE_DEVICES={visible}\n"
            "CUDA_DEVICE_ORDER=PCI_BUS_ID"
        )
    else:
        click.echo(docker_gpus(got.uuids))


def docker_gpus(uuids: list[str]) -> str:
    """`docker run` arguments for these GPUs that survive an unquoted $(...): the shell
    splits them into words and removes no quotes, and docker parses --gpus as one CSV
    record, so a list goes in double quotes (the comma would split it) and one GPU bare."""
    device = f"device={','.join(uuids)}"
    return f'--gpus "{device}"' if len(uuids) > 1 else f"--gpus {device}"


@gpus.command("attach")
@click.argument("name")
@click.argument("container")
@socket_option
def attach_cmd(name: str, container: str, socket: str) -> None:
    """Name the CONTAINER (an id, or a workload name) a reservation made without one is for.

    Only until the reservation is bound to a container; only by the uid that made it, or
    root.
    """
    from nodeagent.api import client

    client.post(socket, "/v1/gpus/reservations/container", {"name": name, "container": container})
    click.echo(f"reservation {name} is for {container}")


@gpus.command("release")
@click.argument("name")
@socket_option
def release_cmd(name: str, socket: str) -> None:
    """Give back the GPUs reserved under NAME (by the uid that reserved them, or root).

    Only reservations are released by name: a job's GPUs go back when the job ends.
    """
    from nodeagent.api import client

    client.delete(socket, "/v1/gpus/reservations", {"name": name})
    click.echo(f"released {name}")


@gpus.command("place")
@click.option(
    "--count",
    "-k",
    type=click.IntRange(min=1, max=64),
    default=1,
    show_default=True,
    help="How many GPUs (or MIG instances).",
)
@click.option(
    "--busy",
    metavar="IDS",
    default="",
    help="GPUs to treat as taken: indices or UUIDs (GPU or MIG), comma-separated.",
)
@click.option("--memory", metavar="SIZE", help="Free memory each GPU needs, such as 20Gi.")
@click.option(
    "--shared",
    is_flag=True,
    help="Share a GPU with other shared jobs, packed by memory (needs --memory).",
)
@click.option(
    "--mig",
    "mig_profile",
    metavar="PROFILE",
    help="MIG instances of this profile, such as 1g.10gb.",
)
@click.option(
    "--numa",
    metavar="NODES",
    default="",
    help="NUMA nodes of the job's CPUs, such as 1 or 0,1: GPUs there score higher.",
)
@simulate_option
@socket_option
@json_option
def place_cmd(
    *,
    count: int,
    busy: str,
    memory: str | None,
    shared: bool,
    mig_profile: str | None,
    numa: str,
    simulate: str | None,
    socket: str,
    as_json: bool,
) -> None:
    """Which GPUs a job would get now, and why; reserves nothing.

    With a daemon running (and no --simulate), the daemon answers, against what it holds
    now (jobs, reservations, grants); without one, this command reads the GPUs itself and
    says that holds were not considered. Either way a GPU on which compute processes run
    outside any hold is busy: exclusive requests pass it over, and the why: line names it.

    Filter, then score: healthy GPUs with enough free memory that nobody holds, then
    the set whose pairs talk fastest (NVLink, then the PCIe path), on the NUMA nodes
    of the job's CPUs; among equal sets, the one that leaves the best sets for the
    next jobs. Prints the GPUs (indices and UUIDs), the score and its fraction of the
    best possible on an empty node, the pairs, and the reasoning. Exits 1 when
    nothing fits now (the job would wait); a request this node could never satisfy
    (more GPUs than it has, more memory than any GPU, a MIG profile it lacks) is a
    usage error, exit 2, as is a GPU or NUMA node that is not there.

    \b
      nodeagent gpus place --count 2
      nodeagent gpus place --count 4 --busy 0,GPU-5c4f... --json
      nodeagent gpus place --memory 10Gi --shared
      nodeagent gpus place --mig 1g.10gb --simulate config/gpus/h100-mig.yaml
    """
    from nodeagent.api.answers import NotPlaced
    from nodeagent.gpualloc.placement import GpuRequest
    from nodeagent.gpualloc.placing import BadQuestion, Question, numa_nodes, split

    try:
        request = GpuRequest(
            count=count,
            memory=_size(memory),
            shared=shared,
            mig_profile=mig_profile,
            cpu_numa_nodes=numa_nodes(numa),
        )
        question = Question(request, tuple(split(busy)))
        data, note = (None, "--simulate: no daemon asked, holds not considered")
        if simulate is None:
            data, note = _ask_daemon(socket, question)
        if data is None:
            data = _place_here(question, simulate, note)
    except BadQuestion as e:
        raise click.BadParameter(e.message, param_hint=f"--{e.what}") from None
    placed = data.root
    if as_json:
        echo_json(placement_document(data))
    elif isinstance(placed, NotPlaced):
        text = f"nothing fits now: {placed.reason}" + _considered(placed.note)
        click.echo(wrap(text, terminal_width()))
    else:
        click.echo(wrap(_placement_text(placed) + _considered(placed.note), terminal_width()))
    if not placed.placed:
        raise SystemExit(1)


def _considered(note: str | None) -> str:
    return "" if note is None else f"\n({note})"


def _ask_daemon(socket: str, question: Question) -> tuple[Placement | None, str]:
    """The daemon's answer against its live holds; else None and why it gave none (no
    daemon; a daemon without GPUs, or without this route, while this command may read
    some itself, such as a NODEAGENT_GPU_SIM node)."""
    from nodeagent.api import client
    from nodeagent.api.answers import Placement
    from nodeagent.api.client import ApiRefused
    from nodeagent.errors import DaemonUnreachable
    from nodeagent.gpualloc.placing import BadQuestion

    try:
        data = client.get_as(Placement, socket, "/v1/gpus/place", params=question.query())
    except DaemonUnreachable:
        return None, "no daemon: holds not considered"
    except ApiRefused as e:
        what, _, message = str(e).partition(": ")
        if e.status == 400 and what in _QUESTION_PARTS:
            raise BadQuestion(what, message) from None
        if e.status == 404:
            return None, f"the daemon gave no placement ({e}): holds not considered"
        raise
    return data, ""


_QUESTION_PARTS = frozenset({"count", "memory", "shared", "mig", "numa", "busy"})


def _place_here(question: Question, simulate: str | None, note: str) -> Placement:
    """The answer from this command's own reading of the GPUs: no holds but --busy; `note`
    says why holds were not considered."""
    from nodeagent.api.answers import Placement
    from nodeagent.gpu.model import GpuState
    from nodeagent.gpualloc.placement import Holdings, node_gpus
    from nodeagent.gpualloc.placing import answer

    backend = _open(simulate)
    try:
        devices = backend.inventory()
        if not devices:
            raise NodeagentError(f"no GPUs: {backend.reason}")
        state = GpuState(
            devices,
            backend.topology(),
            backend.telemetry(),
            backend.processes(),
            (),
            backend.source,
            backend.simulated,
        )
    finally:
        backend.close()
    placed = answer(
        question,
        node_gpus(state),
        Holdings(),
        source=state.source,
        simulated=state.simulated,
        holds_considered=False,
    )
    return Placement.model_validate({**placed, "note": note})


def _size(text: str | None) -> int | None:
    from nodeagent.policyfile.units import parse_size

    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--memory") from None


def _placement_text(d: Placed) -> str:
    where = "simulated node" if d.simulated else d.source
    plural = "s" if len(d.uuids) > 1 else ""
    gpus = sorted(set(d.indices))
    on = f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))}"
    if d.request.mig_profile:
        on = f"{len(d.uuids)} MIG instance{plural} ({d.request.mig_profile}) on {on}"
    lines = [f"would place on {on} ({where}; nothing reserved)"]
    lines += [f"  GPU {g.index}  {g.uuid}  NUMA {_num(g.numa_node)}" for g in d.devices]
    if d.pairs:
        lines.append(
            f"score {d.score} (pairs {d.pair_score} + NUMA {d.numa_bonus}); "
            f"{d.fraction:.2f} of the best {len(d.indices)}-GPU set on an empty node "
            f"({d.best_possible})"
        )
        lines.append("pairs:")
        lines += [
            f"  {q.gpus[0]}-{q.gpus[1]}  "
            + (f"NV{q.nvlinks}{' (NVSwitch)' if q.nvswitch else ''} " if q.nvlinks else "")
            + f"{q.pcie}  {q.score}"
            for q in d.pairs
        ]
    lines.append(f"NUMA nodes: {', '.join(map(str, d.numa_nodes)) or '-'}")
    lines.append(f"why: {d.reason}")
    return "\n".join(lines)
