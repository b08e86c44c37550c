"""Deadlines: jobs that declared their work and a deadline get the CPU rate they need.

Each tick, for each deadline job: remaining work W = declared work - CPU used since its
cgroup was made (cpu.stat), window D = deadline - now, parallelism p = the fewest of its
declared CPUs, its threads and the node's CPUs. `edf.admit` keeps, by priority then
earliest deadline, the jobs that can all finish on the CPU left by the reservations; each
admitted job gets an exclusive floor of its rate times `deadlines.headroom` (at most p),
which `CpuWeights` turns into weight. Jobs that cannot fit are predicted to miss and
reported; they get what CPU is left, up to the rate they need, earliest deadline first, so
they are late by the least. Jobs whose deadline has passed or that overran their declared
work fall back to fair share. Re-planned every tick from what was measured, so a job that
runs faster or slower than declared is followed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nodeagent.policy.base import Assignment, Floor, Note, Output, PolicyInput
from nodeagent.policy.cpu import reserved, usable
from nodeagent.policy.edf import Demand, admit, best_effort, rates
from nodeagent.snapshot import WorkloadState


def parallelism(w: WorkloadState, a: Assignment, cpus: int) -> float:
    limits = [float(cpus)]
    if a.cpus is not None:
        limits.append(a.cpus)
    if w.sample.threads is not None and w.sample.threads > 0:
        limits.append(float(w.sample.threads))
    return min(limits)


@dataclass(frozen=True, slots=True)
class _Job:
    w: WorkloadState
    a: Assignment
    remaining: float
    window: float
    p: float


class Deadlines:
    name = "deadlines"

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        settings = given.spec.deadlines
        if not settings.enabled:
            return []
        now = given.snapshot.wall_time
        cpus = given.snapshot.node.cpu_count
        out: list[Output] = []
        demands: dict[str, Demand] = {}
        jobs: dict[str, _Job] = {}
        for w in given.snapshot.workloads:
            a = given.assignments.get(w.path)
            if a is None or a.deadline is None or a.work is None:
                continue
            if w.sample.cpu_usage_us is None:
                continue  # no cpu.stat: nothing to measure progress with
            remaining = a.work - w.sample.cpu_usage_us / 1e6
            window = a.deadline - now
            job = jobs[w.path] = _Job(w, a, remaining, window, parallelism(w, a, cpus))
            if remaining <= 0:
                out.append(self._note(job, "overrun" if w.sample.populated else "done", None, now))
            elif window <= 0:
                out.append(self._note(job, "missed", None, now))
            elif w.sample.populated is False:
                out.append(self._note(job, "waiting", None, now))
            else:
                priority = given.spec.classes[a.workload_class].priority
                demands[w.path] = Demand(w.path, remaining, window, job.p, priority)

        capacity = max(0.0, usable(given) - sum(reserved(given).values()))
        admitted, missed = admit(list(demands.values()), capacity)
        allotted = rates(admitted, capacity)
        given_rates: dict[str, float] = {}
        for d in admitted:
            given_rates[d.name] = min(jobs[d.name].p, allotted[d.name] * settings.headroom)
        left = max(0.0, capacity - sum(given_rates.values()))
        given_rates.update(best_effort(missed, left))
        for d in admitted:
            job = jobs[d.name]
            rate = given_rates[d.name]
            floor_why = (
                f"needs {d.rate:.3f} cores ({d.work:.1f} CPU-s in {d.window:.1f} s);"
                f" given {allotted[d.name]:.3f} x headroom {settings.headroom:g}"
                f" = {rate:.3f} (parallelism {job.p:g})"
            )
            out.append(
                Floor(
                    d.name,
                    rate,
                    self.name,
                    f"deadline in {d.window:.0f} s: floor {rate:.2f} cores",
                    (
                        f"admitted by EDF among {len(demands)} deadline job(s) on"
                        f" {capacity:.2f} cores (usable less reservations)",
                        floor_why,
                    ),
                    exclusive=True,
                )
            )
            out.append(self._note(job, "on-track", rate, now))
        for d in missed:
            rate = given_rates[d.name]
            if rate > 0:
                out.append(
                    Floor(
                        d.name,
                        rate,
                        self.name,
                        f"predicted to miss: floor {rate:.2f} cores so it is late by the least",
                        (f"needs {d.rate:.3f} cores; {left:.2f} left after the admitted jobs",),
                        exclusive=True,
                    )
                )
            out.append(self._note(jobs[d.name], "predicted-miss", rate, now))
        return out

    def _note(self, job: _Job, status: str, rate: float | None, now: float) -> Note:
        w, a, remaining, window, p = job.w, job.a, job.remaining, job.window, job.p
        assert a.deadline is not None
        required = remaining / window if window > 0 and remaining > 0 else None
        pace = rate if rate is not None else w.cpu_rate
        finish = now + remaining / pace if remaining > 0 and pace else None
        slack = window - max(0.0, remaining) / p
        message = {
            "on-track": f"on track: {remaining:.1f} CPU-s left, {window:.0f} s to the deadline",
            "predicted-miss": f"predicted to miss: {remaining:.1f} CPU-s left cannot fit"
            f" in {window:.0f} s with the other deadlines; given what is left",
            "missed": f"missed its deadline {-window:.0f} s ago with {remaining:.1f} CPU-s"
            " left; fair share meanwhile",
            "overrun": f"used {-remaining:.1f} CPU-s more than it declared and still runs;"
            " fair share meanwhile",
            "done": "its declared work is done",
            "waiting": "holds no process yet",
        }[status]
        return Note(
            w.path,
            self.name,
            "deadline",
            status,
            message,
            {
                "deadline": a.deadline,
                "work": a.work,
                "remaining": remaining,
                "required_rate": required,
                "rate": rate,
                "measured_rate": w.cpu_rate,
                "parallelism": p,
                "slack": slack,
                "predicted_finish": finish,
            },
        )
