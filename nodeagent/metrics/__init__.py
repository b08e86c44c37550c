"""The Prometheus endpoint: what the agent set and measured, per workload, tenant and tick.

`families` lists every series; `collector` renders them from the latest tick; `gpus`
adds a GPU backend's figures once the daemon has one; `server` serves them over HTTP.
"""
