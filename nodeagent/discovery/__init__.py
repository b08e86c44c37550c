"""Discovery: find the workloads in the cgroup v2 tree and say what each one is."""
