"""The daemon's local API: HTTP+JSON over a Unix socket, guarded by file mode and peer credentials.

A Unix socket rather than TCP so that the kernel, not a token, says who is calling: the
file mode keeps strangers out and SO_PEERCRED tells the server exactly which uid connected.
"""
