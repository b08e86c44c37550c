"""Workload identity from the container runtimes: who a container is by the names operators use.

Discovery knows a cgroup by its path; the runtime that made it knows its name, image, labels
and pod. One adapter per runtime (`docker`, `podman`, `cri` for containerd and CRI-O), behind
one interface (`base.Adapter`), read-only, every call within a deadline; `metadata` is the
sensing side: it asks, caches by container id, follows the runtimes' events, and freezes the
answers into each workload's identity before the pure classifier matches rules on them.
"""
