"""Who may use which tenants and classes: `jobs.access` in the policy.

A tenant and a class are what a job (or a GPU request or reservation) competes with: the
inference class protects itself by throttling and freezing every lower class, and a
tenant's shares decide the node's CPU. So the socket group alone does not let a user take
either. Root may use every tenant and class. Everyone else may use `jobs.default_tenant`
with `jobs.default_class`, and any pair that one `jobs.access` entry naming them (by user
or group) lists both. `refusal` is the one rule, for /v1/jobs and the GPU routes alike;
`caller` resolves the names it compares (NSS), once per request.

A deadline is granted through the class: its floor takes CPU ahead of every tenant's
share, and a defended one has the protection controller throttle and freeze lower classes,
so a caller other than root may declare one (`exec --deadline`, a GPU request's) only in a
class whose `declared_deadlines` is `scheduled` or `defended` (`check_deadline`); who may
use that class is `jobs.access`'s to say, as above.
"""

from __future__ import annotations

import difflib
import grp
import pwd
from dataclasses import dataclass

from nodeagent.api.peer import Peer
from nodeagent.errors import BadRequest, Forbidden
from nodeagent.policyfile.model import ANY, AccessEntry, DeadlineGrant, PolicySpec, WorkloadClass


@dataclass(frozen=True, slots=True)
class Caller:
    uid: int
    user: str | None
    gids: frozenset[int]
    groups: frozenset[str]


def caller(peer: Peer) -> Caller:
    """The peer with its user and group names (None or left out where NSS has none)."""
    try:
        user: str | None = pwd.getpwuid(peer.uid).pw_name
    except (KeyError, OverflowError):
        user = None
    gids = frozenset({peer.gid, *peer.groups})
    names = set()
    for gid in gids:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except (KeyError, OverflowError):
            continue
    return Caller(peer.uid, user, gids, frozenset(names))


def _names(entry: AccessEntry, who: Caller) -> bool:
    return any(u == who.uid if isinstance(u, int) else u == who.user for u in entry.users) or any(
        g in who.gids if isinstance(g, int) else g in who.groups for g in entry.groups
    )


def _lists(entry: AccessEntry, tenant: str, cls: WorkloadClass) -> bool:
    return (ANY in entry.tenants or tenant in entry.tenants) and (
        ANY in entry.classes or cls in entry.classes
    )


def refusal(spec: PolicySpec, who: Caller, tenant: str, cls: WorkloadClass) -> str | None:
    """Why `who` may not use `tenant` with `cls`; None when it may. Pure."""
    if who.uid == 0:
        return None
    if tenant == spec.jobs.default_tenant and cls == spec.jobs.default_class:
        return None
    if any(_names(e, who) and _lists(e, tenant, cls) for e in spec.jobs.access):
        return None
    name = f"uid {who.uid}" + (f" ({who.user})" if who.user else "")
    return (
        f"{name} may not use tenant {tenant!r} with class {cls}: only root, the policy's"
        " defaults (jobs.default_tenant, jobs.default_class) and the pairs jobs.access"
        " grants it"
    )


def tenant_and_class(
    spec: PolicySpec, peer: Peer, tenant: str | None, cls: WorkloadClass | None
) -> tuple[str, WorkloadClass]:
    """The tenant and class a request asks for (or the policy's defaults), known and
    allowed to its caller; else the one-line API error that says why not."""
    tenant = tenant or spec.jobs.default_tenant
    if tenant is None:
        raise BadRequest(
            "no tenant: pass --tenant, or name a default in the policy (jobs.default_tenant)"
        )
    if tenant not in spec.tenants:
        close = difflib.get_close_matches(tenant, list(spec.tenants), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        names = sorted(spec.tenants)
        listed = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        raise BadRequest(f"unknown tenant {tenant!r}{hint} (tenants: {listed})")
    cls = cls or spec.jobs.default_class
    why = refusal(spec, caller(peer), tenant, cls)
    if why is not None:
        raise Forbidden(why)
    return tenant, cls


def check_deadline(spec: PolicySpec, peer: Peer, cls: WorkloadClass) -> None:
    """Refuse (403) a deadline `peer` declares in class `cls` where the policy grants none:
    root's is the operator's word; anyone else's gets what `classes.<cls>.declared_deadlines`
    says, and `refused` (the default) refuses it."""
    if peer.uid == 0 or spec.classes[cls].declared_deadlines is not DeadlineGrant.REFUSED:
        return
    who = caller(peer)
    name = f"uid {who.uid}" + (f" ({who.user})" if who.user else "")
    raise Forbidden(
        f"{name} may not declare a deadline in class {cls}: classes.{cls}.declared_deadlines"
        " is refused (a deadline's floor takes CPU ahead of every tenant's share); only root,"
        " and classes whose declared_deadlines is scheduled or defended"
    )
