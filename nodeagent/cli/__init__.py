"""The nodeagent command line: run the daemon, and inspect and explain what it does.

One module per group of commands. Commands import what they need when they run, so the
read commands stay light, which matters where Python's imports are slow (a VM's shared
filesystem).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from nodeagent.cli import (
    capacity,
    control,
    examples,
    exec,
    gpus,
    inspection,
    release,
    run,
    units,
    validate,
)
from nodeagent.errors import NodeagentError


class _Context(click.Context):
    """A usage error raised while this command's arguments are parsed names this command:
    click's parser raises some (an option missing its value) without a context, and the
    hint then lost the command path (`nodeagent: ... (see 'nodeagent --help')`)."""

    def __exit__(self, *exc: Any) -> None:
        error = exc[1]
        if isinstance(error, click.UsageError) and error.ctx is None:
            error.ctx = self
        super().__exit__(*exc)


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    invoke_without_command=True,
    no_args_is_help=False,
)
@click.version_option(package_name="nodeagent")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Set cgroup v2 CPU and memory controls for this host's workloads from a policy file.

    \b
    Start here:
      nodeagent example-policy > policy.yaml    start a policy from the example
      nodeagent validate policy.yaml            check a policy file
      nodeagent workloads --config FILE         what discovery finds, and which rule claims it
      nodeagent run --config FILE --dry-run     print the plan, write nothing
      nodeagent run --config FILE               the daemon (as root, on cgroup v2)
      nodeagent status                          what runs, and what is wrong
      nodeagent reload                          have the daemon re-read its policy
      nodeagent allocations                     what the daemon set, and why
      nodeagent explain CGROUP                  the full policy trace for one workload
      nodeagent exec --deadline +2h --work 3h -- CMD
                                                run CMD as a job, in time for its deadline
      nodeagent gpus                            this node's GPUs, their health and users
      nodeagent capacity --arrival-rate L ...   replicas for a mean wait (M/M/c, Erlang C)
    """
    if ctx.invoked_subcommand is None:  # bare `nodeagent`: the help, as kubectl does
        click.echo(ctx.get_help())


for _command in (
    validate.validate,
    run.run,
    control.status,
    control.reload,
    inspection.workloads,
    inspection.allocations_cmd,
    inspection.explain,
    exec.exec_cmd,
    capacity.capacity,
    gpus.gpus,
    release.release,
    units.unit,
    examples.example_policy,
):
    main.add_command(_command)


def _with_context_class(command: click.Command) -> None:
    command.context_class = _Context
    for sub in getattr(command, "commands", {}).values():
        _with_context_class(sub)


_with_context_class(main)


def entrypoint() -> None:
    """Console script: one-line errors for everything an operator can get wrong."""
    try:
        # NO_COLOR (no-color.org): click strips any style from what the commands print
        main(standalone_mode=False, color=False if os.environ.get("NO_COLOR") else None)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx else "nodeagent"
        message = " ".join(e.format_message().split())
        click.echo(f"{where}: error: {message} (see '{where} --help')", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except NodeagentError as e:
        click.echo(f"nodeagent: error: {e}", err=True)
        sys.exit(1)
