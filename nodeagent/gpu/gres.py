"""Which GPUs Slurm gave a job on this node, read from `scontrol show job -d --oneliner <id>`:
pure.

What was relied on (SchedMD/slurm): the record is printed by slurm_sprint_job_info
(src/api/job_info.c in 22.05, src/scontrol/info_job.c since 23.02), one record a line with
--oneliner, fields separated by single spaces, `JobId=<id>` first. Only for a job with
resources (a running one) does it print, after `NtasksPerN:B:S:C=... CoreSpec=...`,
`JOB_GRES=<total>` and then, with -d, one entry per group of nodes whose allocation is the
same, `Nodes=<hostlist> CPU_IDs=<cpus> Mem=<MB> GRES=<detail>` (22.05 already groups by GRES
too: commit 45153689bd, "Show job GRES index info with scontrol -d show job"), before
`MinCPUsNode=`. The detail (gres_ctld_job_build_details in 22.05's src/slurmctld/gres_ctld.c,
gres_stepmgr_job_build_details since) is comma-separated, one part per GRES of the job:
`gpu:2(IDX:0-1)`, `gpu:a100:2(IDX:0,2)` (name, type, count on the node, and the indices of the
node's GRES records that it holds, in Slurm's bit_fmt: `0-1,3`), `gpu(CNT:2)` (a GRES without
device files: no indices), a shared GRES's `shard:2(2/4,0/4)` (newer Slurm), or nothing on a
node the job has none of (empty, or `(null)`). `IDX:N/A` is `scontrol show node`'s, never a job's.
A job array's task and a heterogeneous job's component each have their own JobId (and their own
job_<id> cgroup); asking for an array's or a het job's first id lists every record, so the record
whose JobId is the id asked for is the one read.

The record is the job's user's to fill in part (its name, command, working directory, comment),
and with a newline or a space there they could write what looks like another record or another
node's entry. So the answer is refused whole (BadAnswer) unless it is exactly as Slurm prints it:
every line a record (`JobId=<digits> ...`), exactly one record of the job, and the detail's keys
(`JOB_GRES=`, `Nodes=`, `CPU_IDs=`, `Mem=`, `GRES=`) nowhere in it but in the one detail section,
which is whole groups of the four. A refusal holds nothing: the job's GPU processes stay
violations, never the other way round.

What IDX means: the index of the GRES record in the node's list (gres.conf's `File=` order, each
range expanded; with AutoDetect=nvml, NVML's order, by PCI bus id). nodeagent takes GRES index i to
be the GPU with the i-th lowest /dev/nvidia minor number (NVML's index where the minor is not
known), which is both of those on a node whose gres.conf lists every GPU as
`File=/dev/nvidia[0-N]`, since the driver numbers its minors in PCI bus order (docs/gpus.md says
how an operator checks it). On a node with MIG instances Slurm's records are the instances: no
index is mapped there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nodeagent.gpu.grants import GpuGrant
from nodeagent.gpu.model import GpuState
from nodeagent.meta import BadAnswer

GPU = "gpu"
VIA = "Slurm GRES index"
MAX_INDEX = 1023
"""The highest GRES index read (a node with more GPUs than this is not a node)."""
MAX_HOSTS = 65536
"""Nodes one range of a hostlist may name."""
_RECORD = re.compile(r"JobId=([0-9]{1,20})(?: |$)", re.ASCII)
_DETAIL_KEYS = ("JOB_GRES=", "Nodes=", "CPU_IDs=", "Mem=", "GRES=")
_END = "MinCPUsNode="
_PART = re.compile(
    r"(?P<name>[A-Za-z0-9_.-]+)(?::(?P<type>[^:(),\s]+)(?=:))?(?::(?P<count>[0-9]+))?"
    r"\((?P<inner>[^()\s]*)\)",
    re.ASCII,
)
_RANGE = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?", re.ASCII)
_HOST = re.compile(r"[^\[\],\s]*(?:\[[^\[\]\s]*\][^\[\],\s]*)*", re.ASCII)


@dataclass(frozen=True, slots=True)
class NodeGres:
    """One `Nodes=... GRES=...` entry of a job: the nodes it names and its gpu indices."""

    nodes: str
    gpus: tuple[int, ...]


def _ranges(text: str, what: str, limit: int) -> list[int]:
    """Slurm's bit_fmt (`0-1,3`), or a hostlist bracket's ranges: the numbers, in order."""
    out: list[int] = []
    for part in text.split(","):
        m = _RANGE.fullmatch(part)
        if m is None:
            raise BadAnswer(f"{what} {text!r} is not a list of numbers and ranges")
        first = int(m.group(1))
        last = first if m.group(2) is None else int(m.group(2))
        if last < first or last > limit or len(out) + last - first >= MAX_HOSTS:
            raise BadAnswer(f"{what} {text!r} is out of range")
        out += range(first, last + 1)
    return out


def _gpus(detail: str) -> tuple[int, ...]:
    """The gpu indices of one node's GRES detail (every GRES part checked, only gpu's kept)."""
    if detail in ("", "(null)"):
        return ()
    found: set[int] = set()
    rest = detail
    while rest:
        m = _PART.match(rest)
        if m is None:
            raise BadAnswer(f"GRES detail {detail!r} is not name[:type]:count(...) parts")
        rest = rest[m.end() :]
        if rest and not rest.startswith(","):
            raise BadAnswer(f"GRES detail {detail!r} has no comma between its parts")
        rest = rest[1:]
        inner = m.group("inner")
        if m.group("name") != GPU or not inner.startswith("IDX:"):
            continue  # another GRES (a shard's, mps's), or gpu(CNT:n): no index to hold
        indices = _ranges(inner[4:], "GRES index list", MAX_INDEX)
        count = m.group("count")
        if count is None or int(count) != len(set(indices)):
            raise BadAnswer(f"GRES detail {detail!r}: gpu's count is not its indices'")
        found.update(indices)
    return tuple(sorted(found))


def hostlist_has(hostlist: str, node: str) -> bool:
    """Whether Slurm's hostlist (`node[01-03,7],gpu-a[1-2]-x`) names `node`; BadAnswer for one
    that is not a hostlist."""
    rest = hostlist
    while rest:
        m = _HOST.match(rest)
        assert m is not None  # the pattern matches the empty string
        entry = m.group(0)
        rest = rest[m.end() :]
        if not entry or (rest and not rest.startswith(",")):
            raise BadAnswer(f"Nodes={hostlist!r} is not a Slurm hostlist")
        rest = rest[1:]
        if _names(entry, node):
            return True
    return False


def _names(entry: str, node: str) -> bool:
    """Whether one hostlist entry (brackets expanded, each range zero-padded to its first
    number's width, as Slurm writes `[08-10]`) names `node`."""
    pieces = re.split(r"\[([^\[\]]*)\]", entry)
    pattern = re.escape(pieces[0])
    for n in range(1, len(pieces), 2):
        names = {
            str(i).zfill(len(part.partition("-")[0]))
            for part in pieces[n].split(",")
            for i in _ranges(part, "hostlist range", 10**5 - 1)
        }
        pattern += "(?:" + "|".join(re.escape(s) for s in sorted(names)) + ")"
        pattern += re.escape(pieces[n + 1])
    return re.fullmatch(pattern, node) is not None


def _record(text: str, job_id: str) -> list[str]:
    """The tokens of the job's one record."""
    mine: list[list[str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _RECORD.match(line)
        if m is None:
            raise BadAnswer(f"line {n} is not a job record (JobId=...): {line[:80]!r}")
        if m.group(1) == job_id:
            mine.append(line.split())
    if len(mine) != 1:
        raise BadAnswer(f"the answer has {len(mine)} records of job {job_id}, not one")
    return mine[0]


def job_node_gres(text: str, job_id: str) -> tuple[NodeGres, ...]:
    """Each `Nodes= ... GRES=` entry of job `job_id`'s record in `scontrol show job -d
    --oneliner`'s answer; () for a job without resources (not running). BadAnswer for an
    answer that is not exactly as Slurm prints it (the module's docstring)."""
    tokens = _record(text, job_id)
    starts = [n for n, t in enumerate(tokens) if t.startswith("JOB_GRES=")]
    ends = [n for n, t in enumerate(tokens) if t.startswith(_END)]
    if not starts:
        detail: list[str] = []
        start = end = len(tokens)
    elif len(starts) > 1:
        raise BadAnswer(f"job {job_id}'s record has {len(starts)} JOB_GRES= fields")
    else:
        start = starts[0]
        end = next((n for n in ends if n > start), -1)
        if end < 0:
            raise BadAnswer(f"job {job_id}'s record has no {_END} after its JOB_GRES=")
        detail = tokens[start + 1 : end]
    outside = [
        t for n, t in enumerate(tokens) if not start <= n < end and t.startswith(_DETAIL_KEYS)
    ]
    if outside:
        raise BadAnswer(f"job {job_id}'s record has {outside[0][:40]!r} outside its GRES detail")
    if len(detail) % 4:
        raise BadAnswer(f"job {job_id}'s GRES detail is not Nodes= CPU_IDs= Mem= GRES= groups")
    out = []
    for n in range(0, len(detail), 4):
        group = detail[n : n + 4]
        keys = [t.partition("=")[0] + "=" for t in group]
        if keys != list(_DETAIL_KEYS[1:]):
            raise BadAnswer(f"job {job_id}'s GRES detail has {' '.join(group)[:80]!r}")
        nodes = group[0].partition("=")[2]
        if not nodes:
            raise BadAnswer(f"job {job_id}'s GRES detail names no nodes")
        out.append(NodeGres(nodes, _gpus(group[3].partition("=")[2])))
    return tuple(out)


def slurm_gpus(text: str, job_id: str, node: str) -> GpuGrant:
    """The GRES gpu indices job `job_id` holds on node `node` (as Slurm names it), as a grant
    whose ids are GRES indices (`gres_uuids` maps them to this node's GPUs)."""
    found: set[int] = set()
    entries = job_node_gres(text, job_id)
    mine = [e for e in entries if hostlist_has(e.nodes, node)]
    if entries and not mine:
        # with -d Slurm lists every node of a running job: this node's name is not Slurm's
        names = " ".join(e.nodes for e in entries)
        raise BadAnswer(
            f"job {job_id} runs on {names}, which does not name {node!r}: set"
            " agent.slurm.node to this node's Slurm name (slurmd -C)"
        )
    for entry in mine:
        found.update(entry.gpus)
    return GpuGrant(False, tuple(str(i) for i in sorted(found)), VIA) if found else GpuGrant()


def gres_uuids(grant: GpuGrant, gpus: GpuState) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the UUIDs of the GPUs a grant of GRES indices names, sorted; the indices this node has
    no GPU for). GRES index i is the GPU with the i-th lowest /dev/nvidia minor (NVML's index
    order where minors are not known); on a node with MIG instances no index is mapped, nor
    where the minors have a gap (a GPU NVML no longer lists, fallen off the bus: each index
    past it would name its neighbour)."""
    if any(d.mig_devices for d in gpus.devices):
        return (), grant.ids
    minors = sorted(d.minor for d in gpus.devices if d.minor is not None)
    if minors and minors != list(range(len(minors))):
        return (), grant.ids
    ordered = sorted(gpus.devices, key=lambda d: (d.minor is None, d.minor or 0, d.index))
    uuids, foreign = set[str](), list[str]()
    for i in grant.ids:
        n = int(i)
        if n < len(ordered):
            uuids.add(ordered[n].uuid)
        else:
            foreign.append(i)
    return tuple(sorted(uuids)), tuple(foreign)
