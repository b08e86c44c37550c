"""The read commands: what discovery finds, what the daemon set, and why."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import click

from nodeagent.cli.common import json_option, load, socket_option, wide_option
from nodeagent.cli.output import (
    counted,
    document,
    echo_json,
    item_list,
    renamed,
    terminal_width,
)
from nodeagent.errors import NodeagentError
from nodeagent.policy.notes import NoteKind
from nodeagent.tables import (
    SHOWN,
    Fitted,
    Keep,
    age,
    cores,
    fit,
    fittest,
    fold,
    percent,
    printable,
    runtime_name,
    setting,
    short_ids,
    size,
    table,
    workload_name,
    yes_no,
)

if TYPE_CHECKING:  # the commands import the API's client and answers when they run
    from nodeagent.api.answers import (
        Allocation,
        Allocations,
        DeadlineFigures,
        Explanation,
        Workload,
    )

# The --json documents (see cli/output.py): the daemon's answers with units in their keys.
_ROW_UNITS = {"cpu_rate": "cpu_rate_cores", "memory_current": "memory_current_bytes"}
_DEADLINE_UNITS = {
    "deadline": "deadline_timestamp_seconds",
    "work": "work_cpu_seconds",
    "remaining": "remaining_cpu_seconds",
    "required_rate": "required_rate_cores",
    "rate": "rate_cores",
    "measured_rate": "measured_rate_cores",
    "slack": "slack_seconds",
    "predicted_finish": "predicted_finish_timestamp_seconds",
    "capacity": "capacity_cores",
}
_NOTE_UNITS = {
    NoteKind.DEADLINE: _DEADLINE_UNITS,
    NoteKind.PROTECTION: {"caps": "caps_cores", "stalling": "stalling_fraction"},
    NoteKind.HIERARCHY: {"planned": "planned_fraction", "expected": "expected_fraction"},
}
_SENSED_UNITS = {
    "cpu_rate": "cpu_rate_cores",
    "cpu_pressure_some_avg10": "cpu_pressure_some_avg10_percent",
    "memory_current": "memory_current_bytes",
    "memory_anon": "memory_anon_bytes",
    "memory_file": "memory_file_bytes",
    "memory_low": "memory.low",  # the cgroup file's text, as in values
    "memory_min": "memory.min",
    "cpu_stall": "cpu_stall_fraction",
    "memory_pressure_some_avg10": "memory_pressure_some_avg10_percent",
}


def _note_document(note: Mapping[str, Any]) -> dict[str, Any]:
    return renamed(note, _NOTE_UNITS.get(note.get("kind", ""), {}))


def _workload_document(row: Mapping[str, Any]) -> dict[str, Any]:
    """One allocation or explanation: units in its keys, its deadline's and notes' too."""
    out = renamed(row, _ROW_UNITS)
    if out.get("deadline") is not None:
        out["deadline"] = renamed(out["deadline"], _DEADLINE_UNITS)
    if "notes" in out:
        out["notes"] = [_note_document(n) for n in out["notes"]]
    if "sensed" in out:
        out["sensed"] = renamed(out["sensed"], _SENSED_UNITS)
    return out


def allocations_document(answer: Allocations) -> dict[str, Any]:
    """`allocations --json`: kind Allocations, the tick's figures, `allocations` (one per
    workload and parent level) and `node_notes`."""
    data = answer.model_dump(by_alias=True)
    body = renamed(
        data,
        {"time": "timestamp_seconds", "tenant_usage": "tenant_usage_cpu_seconds"},
    )
    body["allocations"] = [_workload_document(a) for a in data["allocations"]]
    body["node_notes"] = [_note_document(n) for n in data["node_notes"]]
    return document("Allocations", body)


def explanation_document(answer: Explanation) -> dict[str, Any]:
    """`explain --json`: kind Explanation; under `explanation`, one workload's values,
    trace and sensed figures (under a key of its own: a workload has a kind too)."""
    data = answer.model_dump(by_alias=True)
    return document("Explanation", {"explanation": _workload_document(data)})


def _mode(write: str | None) -> str:
    """' (read-only)' or ' (via systemd)' after a cgroup the agent does not write directly."""
    return {"read-only": " (read-only)", "systemd": " (via systemd)"}.get(write or "", "")


def _setting(row: Allocation, attribute: str, compact: bool = False) -> str | None:
    """One cell; none where the answer has no such attribute (a daemon from before it was
    shown: pids.max)."""
    v = row.values.get(attribute)
    if v is None:
        return None
    return setting(attribute, v.current, v.target, row.write != "read-only", compact=compact)


def _why(row: Allocation) -> str:
    """The reason for a row's values, or what went wrong, and what a rule refused."""
    said = row.reason if row.status == "ok" else f"{row.status.upper()}: {row.problem}"
    return "; ".join([said, *(f"REFUSED {x}" for x in row.refused)])


COMPACT = ("WEIGHT", "CAP", "MEM", "HIGH", "PIDS")
"""The compact layout's headers for the attributes in `SHOWN`: CAP is cpu.max in cores."""


def allocations_table(
    data: Allocations | Mapping[str, Any], *, width: int | None = None, wide: bool = True
) -> str:
    """The allocations as a table; not `wide`: short ids, and the GPUS column only where a
    workload holds GPUs; `width`: reasons, then paths, cut to fit, and where that hides
    more (or cuts into a name's leaf) the compact layout: shorter headers, the runtime's name
    apart from its image, cpu.max in cores. A mapping (what report.allocations builds, as
    `run --once` has it) is read as the answer would be."""
    from nodeagent.api.answers import Allocations

    if not isinstance(data, Allocations):
        data = Allocations.model_validate(data)
    allocated = data.allocations
    gpus = wide or any(a.gpus for a in allocated)
    fitted = _full_layout(allocated, width=width, wide=wide, gpus=gpus)
    compact = False
    if width is not None and (fitted.hidden or fitted.leaves_cut or fitted.over):
        narrow = _compact_layout(allocated, width=width, wide=wide, gpus=gpus)
        # the full layout shows an image only cut, after the name: its going is no loss
        compact = fittest(fitted, narrow, uncounted=("IMAGE",)) is narrow
        fitted = narrow if compact else fitted
    mode = " (dry run: nothing written)" if data.dry_run else ""
    levels = sum(1 for a in allocated if a.level)
    found = counted(len(allocated) - levels, "workload") + (
        f", {counted(levels, 'parent level')}" if levels else ""
    )
    head = f"tick {data.tick}{mode}: {found}; OLD->NEW where the kernel differs"
    if compact and "CAP" not in fitted.hidden:
        head += "; CAP: cpu.max in cores"
    ids = (lambda text: text) if wide else short_ids
    notes = [printable(ids(f"{n.kind}: {n.status}: {n.message}")) for n in data.node_notes]
    tail = "".join("\n" + fold(note, width) for note in notes)
    jobs = [(a.cgroup, a.deadline) for a in allocated if a.deadline is not None]
    if jobs:
        misses = "?" if data.deadline_misses is None else str(data.deadline_misses)
        tail += "\n\ndeadline jobs (misses so far: " + misses + ")\n"
        tail += deadlines_table(jobs, data.time, width=width, wide=wide)
    return fold(printable(head), width) + "\n" + fitted.text + tail


def _full_layout(
    allocated: Sequence[Allocation], *, width: int | None, wide: bool, gpus: bool
) -> Fitted:
    """Each cgroup file's values under its name, as the kernel writes them."""
    named = any(_name_image(a) for a in allocated)
    rows = []
    for a in allocated:
        row = [
            (a.cgroup if wide else short_ids(a.cgroup)) + _mode(a.write),
            *((_name_image(a),) if named else ()),
            a.tenant,
            a.workload_class,
            *(_setting(a, str(attribute)) for attribute in SHOWN),
            ",".join(map(str, a.gpus)) or None,
            cores(a.cpu_rate),
            _why(a),
        ]
        at = 3 + named + len(SHOWN)  # the GPUS column
        rows.append(row if gpus else row[:at] + row[at + 1 :])
    headers = [
        "CGROUP", "NAME", "TENANT", "CLASS", "CPU.WEIGHT", "CPU.MAX", "MEM.MAX", "MEM.HIGH",
        "PIDS.MAX", "GPUS", "CPU", "REASON",
    ]  # fmt: skip
    if not gpus:
        headers.remove("GPUS")
    if not named:
        headers.remove("NAME")
    # the reason first; the names last, the workload's own (its runtime's) before its path
    cut: list[tuple[int, Keep]] = [(len(headers) - 1, "head")]
    cut += [(1, "id"), (0, "leaf")] if named else [(0, "leaf")]
    drop = _columns(headers, "PIDS.MAX", "MEM.HIGH", "CPU.MAX", "TENANT", "CLASS", "GPUS", "CPU")
    return fit(headers, rows, width=width, cut=cut, drop=drop)


def _compact_layout(
    allocated: Sequence[Allocation], *, width: int, wide: bool, gpus: bool
) -> Fitted:
    """The same rows in fewer columns: the headers short (`COMPACT`), cpu.max in cores,
    the runtime's name in a column of its own and its image in another, the first to go;
    then the least needed figures, the class, the tenant and (where every row is ok) the
    reason before the limits, the GPUs and the CPU used."""
    columns: list[tuple[str, Sequence[object]]] = [
        (
            "CGROUP",
            [(a.cgroup if wide else short_ids(a.cgroup)) + _mode(a.write) for a in allocated],
        ),
        ("NAME", [runtime_name(a.container_name, a.namespace, a.pod) for a in allocated]),
        ("IMAGE", [a.image for a in allocated]),
        ("TENANT", [a.tenant for a in allocated]),
        ("CLASS", [a.workload_class for a in allocated]),
        *(
            (header, [_setting(a, str(attribute), compact=True) for a in allocated])
            for header, attribute in zip(COMPACT, SHOWN, strict=True)
        ),
        ("GPUS", [",".join(map(str, a.gpus)) or None for a in allocated]),
        ("CPU", [cores(a.cpu_rate) for a in allocated]),
        ("REASON", [_why(a) for a in allocated]),
    ]
    columns = [
        (header, cells)
        for header, cells in columns
        if (header != "GPUS" or gpus) and (header not in ("NAME", "IMAGE") or any(cells))
    ]
    headers = [header for header, _ in columns]
    rows = list(zip(*(cells for _, cells in columns), strict=True))
    cut: list[tuple[int, Keep]] = [(len(headers) - 1, "head")]
    cut += [(i, "tail") for i in _columns(headers, "IMAGE")]
    cut += [(i, "leaf") for i in _columns(headers, "NAME", "CGROUP")]
    # the reason, cut to a few words, goes before the limits where no row has a problem
    quiet = all(a.status == "ok" and not a.refused for a in allocated)
    reason = ("REASON",) if quiet else ()
    least = ("IMAGE", "PIDS", "HIGH", "CLASS", "TENANT", *reason, "MEM", "CAP", "GPUS", "CPU")
    drop = _columns(headers, *least)
    return fit(headers, rows, width=width, cut=cut, drop=drop)


def _columns(headers: Sequence[str], *names: str) -> list[int]:
    """The indices of those of `names` that are among `headers`, in the order named."""
    return [headers.index(name) for name in names if name in headers]


def _name_image(row: Workload) -> str | None:
    """The runtime's name for a workload, and its image: `web-1 (nginx:1.25)`."""
    name, image = runtime_name(row.container_name, row.namespace, row.pod), row.image
    if name is None:
        return image
    return name if image is None else f"{name} ({image})"


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{value:.0f}s"


def _when(at: float | None, now: float) -> str | None:
    if at is None:
        return None
    return f"in {at - now:.0f}s" if at >= now else f"{now - at:.0f}s ago"


def deadlines_table(
    rows: Sequence[tuple[str, DeadlineFigures]],
    now: float,
    *,
    width: int | None = None,
    wide: bool = True,
) -> str:
    """Each deadline job (its cgroup, its figures): status, time to its deadline, remaining
    work (CPU-s), the rate it needs and is given (cores), its slack and its predicted
    finish, relative to now."""
    headers = ("CGROUP", "STATUS", "DEADLINE", "REMAINING", "NEED", "GIVEN", "SLACK", "FINISH")
    body = []
    for cgroup, d in rows:
        body.append(
            (
                cgroup if wide else short_ids(cgroup),
                d.status,
                _when(d.deadline, now),
                f"{d.remaining:.1f}",
                cores(d.required_rate),
                cores(d.rate),
                _seconds(d.slack),
                _when(d.predicted_finish, now),
            )
        )
    # what the others tell is what goes first: the finish (the deadline less the slack)
    drop = [headers.index("FINISH"), headers.index("SLACK")]
    return table(headers, body, width=width, cut=[(0, "leaf")], drop=drop)


@click.command("allocations")
@socket_option
@json_option
@wide_option
def allocations_cmd(socket: str, as_json: bool, wide: bool) -> None:
    """What the daemon set on each workload, the measured CPU (cores), and why.

    Values show OLD->NEW where the kernel still holds something else than the
    plan: in a dry run, for cgroups that are read-only (see `workloads`), or
    when a write failed.
    """
    from nodeagent.api import client
    from nodeagent.api.answers import Allocations

    data = client.get_as(Allocations, socket, "/v1/allocations")
    if as_json:
        echo_json(allocations_document(data))
        return
    width = None if wide else terminal_width()
    click.echo(allocations_table(data, width=width, wide=wide))


@click.command()
@click.argument("cgroup")
@socket_option
@json_option
def explain(cgroup: str, socket: str, as_json: bool) -> None:
    """The policy trace that produced CGROUP's values.

    CGROUP is a path relative to the cgroup root, an absolute path, a workload
    name, the runtime's name for it (a container's name, namespace/pod or
    namespace/pod/container) or a container-id prefix. The answer says what the
    runtime said about it and which of that its rule matched.
    """
    from nodeagent.api import client
    from nodeagent.api.answers import Explanation

    data = client.get_as(Explanation, socket, "/v1/explain", params={"cgroup": cgroup})
    if as_json:
        echo_json(explanation_document(data))
        return
    click.echo(explain_text(data, width=terminal_width()))


def _claim(data: Explanation) -> str:
    """Which rule claims the cgroup, or, for a parent level, what it holds and why it is
    weighted at all."""
    if data.rule is not None:
        return f"rule {data.rule}  tenant {data.tenant}  class {data.workload_class}"
    if data.level:
        tenants = ", ".join(data.below.tenants if data.below else ()) or "none"
        held = data.below.workloads if data.below else 0
        return (
            f"parent level of {held} claimed workload{'' if held == 1 else 's'}"
            f" (tenants: {tenants}); no rule claims it: only its cpu.weight is planned,"
            " so that tenant shares hold across parents (fair_share.hierarchy)"
        )
    return "no rule claims it"


def _explain_metadata(data: Explanation) -> list[str]:
    """What the runtime said, and which of it the rule matched (or refused)."""
    lines = []
    named = _name_image(data)
    if named is not None:
        lines.append(f"  runtime says: {named}")
    if data.metadata_problem:
        lines.append(f"  no runtime metadata: {data.metadata_problem}")
    if data.matched:
        lines.append(f"  rule {data.rule} matched: {', '.join(data.matched)}")
    lines.extend(f"  refused: {x}" for x in data.refused)
    if data.node_critical:
        lines.append(f"  {data.node_critical}: never lowered, capped or frozen")
    return lines


def _sensed(key: str, value: object) -> str:
    """A figure the sensors read, in its unit: sizes, cores, shares, yes or no."""
    if isinstance(value, bool):
        return yes_no(value)
    if isinstance(value, Mapping):
        return " ".join(f"{k}={v}" for k, v in value.items())
    if key.startswith("memory_") and not key.endswith("avg10") and isinstance(value, int | str):
        shown = size(str(value)) or "-"
        return f"{shown} B" if shown.isdigit() else shown
    if isinstance(value, float):
        if key == "cpu_rate":
            return f"{cores(value)} cores"
        if key.endswith("avg10"):
            return f"{value:.2f}% (avg10)"
        if key.endswith(("_fraction", "_stall")):
            return percent(value)
        return f"{value:g}"
    return str(value)


def explain_text(data: Explanation | Mapping[str, Any], *, width: int | None = None) -> str:
    """One workload's explanation; a mapping (what report.explain builds) is read as the
    answer would be. `width`: each line wider is folded (`tables.fold`), nothing cut, its
    continuation under the value it continues: a path wider than a line after a `/`."""
    from nodeagent.api.answers import Explanation

    if not isinstance(data, Explanation):
        data = Explanation.model_validate(data)
    written = data.write != "read-only"
    what = (
        f"({data.kind}, {data.runtime}, owner {data.owner}"
        + ("" if data.write in (None, "direct") else f", {data.write}")
        + ")"
    )
    head = f"{data.cgroup}  {what}"
    # each line, and the column its continuation starts at
    lines: list[tuple[str, int | None]] = (
        [(data.cgroup, 2), (f"  {what}", 3)]
        if width is not None and len(printable(head)) > width
        else [(head, None)]
    )
    lines += [
        (f"  {_claim(data)}", 4),
        *((line, 4) for line in _explain_metadata(data)),
        (
            f"  cpu now: {cores(data.cpu_rate)} cores   (tick {data.tick}"
            + (", dry run" if data.dry_run else "")
            + ")",
            4,
        ),
        *((line, 4) for line in _explain_gpus(data, time.time())),
        ("values:", None),
    ]
    for attr in SHOWN:
        v = data.values.get(attr)  # none from a daemon from before pids.max was shown
        if v is not None and (v.target is not None or v.current is not None):
            why = f"  [{v.policy}] {v.reason}" if v.policy else ""
            shown = setting(attr, v.current, v.target, written)
            lines.append((f"  {attr:<12} {shown}{why}", 15))
    sensed = [(k, v) for k, v in data.sensed.items() if v not in (None, {})]
    if sensed:
        lines.append(("sensed this tick:", None))
        lines.extend((f"  {k:<28} {_sensed(k, v)}", 31) for k, v in sensed)
    lines.append(("trace:", None))
    lines.extend((f"  {t}", 4) for t in data.trace or [data.reason or "nothing planned"])
    for w in data.writes:
        shown = setting(w.attribute, w.old, w.new)
        lines.append((f"last tick: {w.attribute} {shown}: {w.outcome} {w.detail}", 2))
    return "\n".join(fold(printable(line), width, hang) for line, hang in lines)


def _explain_gpus(data: Explanation, now: float) -> list[str]:
    """The GPUs the workload holds, when they are expected back, and the head of the queue
    they are kept for (EASY backfill)."""
    g = data.gpus
    if g is None:
        return []
    back = "unknown" if g.expected_end is None else f"in {age(float(g.expected_end) - now)}"
    lines = [f"  gpus: {', '.join(map(str, g.indices))} (expected back: {back})"]
    if g.kept_for is not None:
        start = "unknown" if g.kept_from is None else f"in {age(float(g.kept_from) - now)}"
        lines.append(
            f"  kept for {g.kept_for}, first in line (its expected start: {start}): placed"
            " here as expected to give them back by then"
        )
    return lines


def check_cgroup_root(root: str, proc_root: str) -> None:
    """Refuse, as `run` does and with its line, a root that is not a usable cgroup v2
    hierarchy (a v1 or hybrid host, a v2 mount without cpu and memory): read as it is, it
    would list nothing and look like a host without workloads. A plain directory that is no
    mount and lies in none of cgroup's (a copy or a fixture of a tree) is read as it is."""
    from nodeagent.cgroupfs.detect import detect, parse_mountinfo
    from nodeagent.errors import CgroupUnavailable

    try:
        detect(root, proc_root)
    except CgroupUnavailable:
        real = os.path.realpath(root)
        try:
            with open(os.path.join(proc_root, "self/mountinfo"), encoding="ascii") as f:
                mounts = parse_mountinfo(f.read())
        except OSError:
            mounts = []  # the detection's own line says that mountinfo is unreadable
        if not mounts or any(
            real == m.point
            or (m.fstype in ("cgroup", "cgroup2") and real.startswith(m.point.rstrip("/") + "/"))
            for m in mounts
        ):
            raise


@click.command()
@click.option("--cgroup-root", default="/sys/fs/cgroup", show_default=True, metavar="DIR")
@click.option(
    "--proc-root",
    default="/proc",
    show_default=True,
    metavar="DIR",
    help="Where self/mountinfo tells which cgroup hierarchies are mounted.",
)
@click.option("--config", "-c", "config", metavar="FILE", help="Also show each workload's rule.")
@json_option
@wide_option
def workloads(
    cgroup_root: str, proc_root: str, config: str | None, as_json: bool, wide: bool
) -> None:
    """List the workload cgroups discovery finds, reading the tree directly (no daemon).

    Exits 1 with one line naming what is missing where the root is not a cgroup v2
    hierarchy with the cpu and memory controllers (a v1 or hybrid host), as `run` does.
    A plain directory that is not a mount (a copy or fixture of a tree) is read as it is.
    """
    from nodeagent.cgroupfs.tree import CgroupTree
    from nodeagent.discovery.registry import Registry
    from nodeagent.ownership import write_mode
    from nodeagent.policy.classify import assign, nested_warnings, unmatched_for_metadata
    from nodeagent.policyfile.model import AgentSettings
    from nodeagent.report import describe
    from nodeagent.runtimes.metadata import RuntimeMetadata
    from nodeagent.sense.cgroup_files import probe
    from nodeagent.slurm import SlurmJobs

    spec = load(config) if config else None
    agent_settings = spec.agent if spec else AgentSettings()
    managed_root = agent_settings.managed_root
    if not os.path.isdir(cgroup_root):
        raise NodeagentError(f"cgroup root {cgroup_root} is not a directory")
    check_cgroup_root(cgroup_root, proc_root)
    tree = CgroupTree(cgroup_root)
    registry = Registry(tree, managed_root, watch=False)
    registry.resync()
    slurm = SlurmJobs(logs=False)
    found = slurm.enrich(sorted(registry.identities(), key=lambda i: i.path), agent_settings.slurm)
    if slurm.problem is not None:
        click.echo(
            f"warning: Slurm did not answer ({slurm.problem}): its jobs are shown without"
            " their accounts, and rules with `account:` do not claim them",
            err=True,
        )
    # what the runtimes say (read-only, each lookup within agent.runtimes.timeout)
    runtimes = RuntimeMetadata.from_settings(agent_settings.runtimes, budget=5.0, say=False)
    try:
        found = runtimes.attach(found)
    finally:
        runtimes.close()
    assigned = assign(found, spec) if spec else {}
    for warning in nested_warnings(assigned):
        click.echo(f"warning: {warning}", err=True)
    page = os.sysconf("SC_PAGE_SIZE")
    rows: list[dict[str, Any]] = []
    for i in found:
        # claimed workloads are read as the sensor would, so one it would skip shows here
        problem = probe(tree, i.path, page) if i.path in assigned else None
        row = describe(i, assigned.get(i.path), write_mode(i, agent_settings))
        unmatched = unmatched_for_metadata(i, spec) if spec else []
        rows.append(
            {
                **row,
                "status": "ok" if problem is None else "unreadable",
                "problem": problem,
                "unmatched": unmatched,
            }
        )
    rows += [
        {"cgroup": path, "status": "unreadable", "problem": why}
        for path, why in sorted(registry.problems.items())
    ]
    if as_json:
        echo_json(item_list("WorkloadList", rows))
        return
    click.echo(workloads_table(rows, width=None if wide else terminal_width(), wide=wide))


def workloads_table(
    rows: list[dict[str, Any]], *, width: int | None = None, wide: bool = False
) -> str:
    """What discovery found; `wide` adds the id, pod UID and QoS columns and keeps ids whole
    (else they are short, in the path too); `width`: statuses, paths and owners cut to fit."""
    extra = ("ID", "POD", "QOS") if wide else ()
    named = any(workload_name(r) or r.get("image") for r in rows)
    names = ("NAME", "IMAGE") if named else ()
    headers = (
        "CGROUP", *names, "KIND", "RUNTIME", "OWNER", *extra, "TENANT", "CLASS", "STATUS",
    )  # fmt: skip
    body = [
        (
            r["cgroup"] if wide else short_ids(r["cgroup"]),
            *((workload_name(r), r.get("image")) if named else ()),
            r.get("kind"),
            r.get("runtime"),
            None if "owner" not in r else f"{r['owner']}" + _mode(r.get("write")),
            *(
                (r.get("container_id") or r.get("job_id"), r.get("pod_uid"), r.get("qos"))
                if wide
                else ()
            ),
            r.get("tenant"),
            r.get("class"),
            _workload_status(r),
        )
        for r in rows
    ]
    # the status, image and owner first; the names last, the runtime's before the path
    cut: list[tuple[int, Keep]] = [(len(headers) - 1, "head")]
    cut += [(2, "tail"), (5, "head"), (1, "leaf")] if named else [(3, "head")]
    cut.append((0, "leaf"))
    drop = _columns(headers, "IMAGE", "OWNER", "RUNTIME", "KIND", "CLASS", "TENANT")
    return table(headers, body, width=width, cut=cut, drop=drop)


def _workload_status(r: Mapping[str, Any]) -> str:
    """ok or unreadable, then what a rule refused and the rules that need metadata it lacks."""
    status = r["status"] if r["problem"] is None else f"{r['status']}: {r['problem']}"
    said = [*(f"refused {x}" for x in r.get("refused") or ()), *(r.get("unmatched") or ())]
    return "; ".join([status, *said])
