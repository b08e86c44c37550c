"""`gpus place`'s question, asked of the CLI's own reading or of the daemon: checked
against the node, placed against what is held, answered as JSON.

One module for both sides, so that the daemon (`GET /v1/gpus/place`, which places against
its live holds and reserves nothing) and the CLI without a daemon refuse the same input
with the same words and answer in the same shape. A question that is wrong for this node
(a GPU that is not there, a NUMA node without GPUs, a request the node could never
satisfy) is a `BadQuestion` naming the part at fault: a usage error, never "nothing fits".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nodeagent.errors import NodeagentError
from nodeagent.gpualloc.placement import (
    GpuRequest,
    Holdings,
    NodeGpus,
    Placement,
    Refusal,
    impossible,
    place,
)

MAX_COUNT = 64


class BadQuestion(NodeagentError):
    """A question that is wrong for this node; `what` is the part at fault (count, memory,
    shared, mig, numa or busy: the query key, and the CLI option without its dashes)."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(f"{what}: {message}")
        self.what = what
        self.message = message


@dataclass(frozen=True)
class Question:
    request: GpuRequest
    busy: tuple[str, ...] = ()
    """GPUs to treat as taken: indices or UUIDs (GPU or MIG), as given."""

    def query(self) -> dict[str, str]:
        """The question as the API's query string carries it."""
        r = self.request
        out = {"count": str(r.count), "shared": "true" if r.shared else "false"}
        if r.memory is not None:
            out["memory"] = str(r.memory)
        if r.mig_profile is not None:
            out["mig"] = r.mig_profile
        if r.cpu_numa_nodes:
            out["numa"] = ",".join(map(str, sorted(r.cpu_numa_nodes)))
        if self.busy:
            out["busy"] = ",".join(self.busy)
        return out


def split(text: str) -> list[str]:
    """A comma- or space-separated list, as --busy and --numa take them."""
    return [p for p in re.split(r"[,\s]+", text) if p]


def numa_nodes(text: str) -> frozenset[int]:
    parts = split(text)
    if not all(p.isdigit() and len(p) <= 4 for p in parts):
        raise BadQuestion("numa", f"expected NUMA node numbers such as 0 or 0,1, got {text!r}")
    return frozenset(int(p) for p in parts)


def from_query(query: Mapping[str, str]) -> Question:
    """The question in an API query; anything malformed is a BadQuestion."""
    unknown = sorted(set(query) - {"count", "memory", "shared", "mig", "numa", "busy"})
    if unknown:
        raise BadQuestion(unknown[0], "not a placement question's key")
    count = _whole("count", query.get("count", "1"), MAX_COUNT)
    memory = None if "memory" not in query else _whole("memory", query["memory"], 2**60)
    shared = query.get("shared", "false")
    if shared not in ("true", "false"):
        raise BadQuestion("shared", f"expected true or false, got {shared!r}")
    mig = query.get("mig") or None
    request = GpuRequest(count, memory, shared == "true", mig, numa_nodes(query.get("numa", "")))
    return Question(request, tuple(split(query.get("busy", ""))))


def _whole(what: str, text: str, most: int) -> int:
    if not (text.isdigit() and len(text) <= 19 and 1 <= int(text) <= most):
        raise BadQuestion(what, f"expected a whole number from 1 to {most}, got {text!r}")
    return int(text)


def check(question: Question, node: NodeGpus) -> frozenset[str]:
    """The UUIDs --busy names, once the question is known to fit this node: every GPU it
    names is here, its NUMA nodes have GPUs, and the node could satisfy it at all."""
    request = question.request
    if request.shared and request.memory is None:
        raise BadQuestion("shared", "a shared request needs the memory it uses (--memory)")
    by_index = {str(d.index): d.uuid for d in node.devices}
    known = set(by_index.values()) | {m.uuid for d in node.devices for m in d.mig_devices}
    busy = set()
    for token in question.busy:
        uuid = by_index.get(token, token)
        if uuid not in known:
            indices = f"0-{len(node.devices) - 1}" if len(node.devices) > 1 else "0"
            raise BadQuestion(
                "busy", f"no GPU or MIG device {token!r} on this node (indices {indices})"
            )
        busy.add(uuid)
    have = sorted({d.numa_node for d in node.devices if d.numa_node is not None})
    stray = sorted(request.cpu_numa_nodes - set(have))
    if stray:
        where = f"they are on NUMA nodes {', '.join(map(str, have))}" if have else "none says"
        raise BadQuestion("numa", f"no GPU is on NUMA node {stray[0]} ({where})")
    never = impossible(request, node)
    if never is not None:
        raise BadQuestion(never.what, never.reason)
    return frozenset(busy)


def answer(
    question: Question,
    node: NodeGpus,
    held: Holdings,
    *,
    source: str,
    simulated: bool,
    holds_considered: bool,
) -> dict[str, Any]:
    """Where the question would be placed now (reserving nothing), as `gpus place --json`
    prints it; BadQuestion when it is wrong for this node."""
    busy = check(question, node)
    taken = Holdings(held.exclusive | busy, held.shared)
    result = place(question.request, node, taken)
    common = {"source": source, "simulated": simulated, "holds_considered": holds_considered}
    if isinstance(result, Refusal):
        return {"placed": False, **common, "reason": result.reason}
    return placement_json(result, node, question.request) | common


def placement_json(p: Placement, node: NodeGpus, request: GpuRequest) -> dict[str, Any]:
    by_index = {d.index: d for d in node.devices}
    return {
        "placed": True,
        "reserved": False,
        "request": {
            "count": request.count,
            "memory": request.memory,
            "shared": request.shared,
            "mig_profile": request.mig_profile,
            "cpu_numa_nodes": sorted(request.cpu_numa_nodes),
        },
        "uuids": list(p.uuids),
        "indices": list(p.indices),
        "devices": [
            {"index": i, "uuid": u, "numa_node": by_index[i].numa_node}
            for i, u in zip(p.indices, p.uuids, strict=True)
        ],
        "score": p.score,
        "pair_score": p.pair_score,
        "numa_bonus": p.numa_bonus,
        "best_possible": p.best_possible,
        "fraction": round(p.fraction, 4),
        "pairs": [
            {
                "gpus": [q.a, q.b],
                "pcie": q.link.pcie.name,
                "nvlinks": q.link.nvlinks,
                "nvswitch": q.link.nvswitch,
                "score": q.score,
            }
            for q in p.pairs
        ],
        "numa_nodes": list(p.numa_nodes),
        "reason": p.reason,
    }
