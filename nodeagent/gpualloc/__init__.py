"""GPU allocation: who holds which GPUs and why (`ledger`: jobs' holds and reservations),
where a request would go (`placing`, for `nodeagent gpus place`), and the daemon's GPU
service (`service`: sensing, power limits, the /v1/gpus routes).

Above the policies and the sensors it uses (policy.placement, policy.gpu_checks,
sense.gpus); nodeagent.gpu below them holds the devices' model and backends only.
"""
