"""The API's route tables over the domain: each module maps the paths and methods of a part
of the API (`agent`: status, allocations, explain, jobs; `gpus`: /v1/gpus) to handlers that
parse the request, call the domain and answer JSON. The domain refuses with
nodeagent.errors' kinds, which the API server turns into HTTP statuses; nothing here speaks
HTTP itself.

Below the loop, which builds its table from these, and above what they serve (the tick's
record, gpualloc, jobs, access); `nodeagent.api` imports none of them.
"""
