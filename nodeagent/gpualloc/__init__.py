"""GPU allocation: who holds which GPUs and why (`ledger`: jobs' holds and reservations),
which GPUs a request gets (`placement`, pure: the search, and `placement.durations`, how
long holds are expected to last), where a request would go (`placing`, for `nodeagent gpus
place`), and the daemon's GPU service (`service`: the backend, the GPUs read, the ledger's
grants and lapses decided and applied each tick, the frozen view the API reads).

`placement` keeps the policies' purity (its ruff.toml extends nodeagent/policy's bans, and
the import contract "pure" lists it): no I/O, no clock, no randomness. Above the policies
and the sensors it uses (policy.gpu_checks, sense.gpus) and the executor of the GPUs'
power limits (actgpu); nodeagent.gpu below them holds the devices' model and backends only.
The /v1/gpus routes over it are nodeagent.routes.gpus'; it imports neither the API's server
nor its client, and refuses with nodeagent.errors' kinds.
"""
