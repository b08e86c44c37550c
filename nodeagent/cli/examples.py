"""`nodeagent example-policy`: the example policy this install carries, to start one from."""

from __future__ import annotations

from importlib import resources

import click

from nodeagent.errors import NodeagentError

DATA = "data"
"""nodeagent/data/ in the wheel: the example policy, the Grafana dashboard and the Prometheus
alert rules (links to config/ in the source)."""


def packaged(name: str) -> str:
    """A file the install carries in nodeagent/data/."""
    path = resources.files("nodeagent") / DATA / name
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise NodeagentError(
            f"this install carries no {DATA}/{name} ({e.strerror or e}): reinstall nodeagent"
        ) from None


@click.command("example-policy")
def example_policy() -> None:
    """Print the example policy: every key with its default and what it means.

    \b
    Start a policy from it:
      nodeagent example-policy > /etc/nodeagent/policy.yaml
      nodeagent validate /etc/nodeagent/policy.yaml
    """
    click.echo(packaged("policy.yaml"), nl=False)
