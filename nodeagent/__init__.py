"""nodeagent: sets cgroup v2 CPU and memory controls for a host's AI workloads from a policy."""

__version__ = "0.1.0"
