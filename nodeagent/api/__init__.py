"""The daemon's local API: HTTP+JSON over a Unix socket, guarded by file mode and peer credentials.

A Unix socket rather than TCP so that the kernel, not a token, says who is calling: the
file mode keeps strangers out and SO_PEERCRED/SO_PEERGROUPS tell the server exactly which
process, user and groups connected.

Adding an endpoint: a route maps a path to its methods, each a handler taking a
`server.Request` (query, JSON body, the caller's pid/uid/gid/groups):

    {"/v1/jobs": {"GET": list_jobs, "POST": add_job, "DELETE": remove_job}}

A handler returns its answer (200): a model of `answers`, which the CLI reads back by
attribute through the same model; or raises one of nodeagent.errors' refusals
(BadRequest, Forbidden, NotFound, Conflict, TryLater: 400, 403, 404, 409, 503, as
`server.STATUS` maps them) with a message for the user; the domain code raises them without
knowing of HTTP. The CLI calls
`client.get_as` or `client.post_as` with the answer's model (or `client.get`, `post`,
`delete` for the raw JSON); every failure is one line (ApiRefused, with
the status, when the daemon said no; an answer that does not fit its model names the socket
and the path).
"""
