"""The cgroup v2 filesystem: safe paths, interface-file parsers, validated values, detection."""
