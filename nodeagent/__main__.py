"""`python -m nodeagent` is the `nodeagent` command."""

from nodeagent.cli import entrypoint

entrypoint()
