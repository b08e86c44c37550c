"""GPU allocation: who holds which GPUs and why (`ledger`: jobs' holds and reservations),
where a request would go (`placing`, for `nodeagent gpus place`), and the daemon's GPU
service (`service`: the backend, sensing, the ledger's upkeep each tick).

Above the policies and the sensors it uses (policy.placement, policy.gpu_checks,
sense.gpus) and the executor of the GPUs' power limits (actgpu); nodeagent.gpu below them
holds the devices' model and backends only. The /v1/gpus routes over it are
nodeagent.routes.gpus'; it imports neither the API's server nor its client, and refuses
with nodeagent.errors' kinds.
"""
