"""The nodeagent command line: run the daemon, and inspect and explain what it does.

One module per group of commands. Commands import what they need when they run, so the
read commands stay light, which matters where Python's imports are slow (a VM's shared
filesystem).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

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

_NO_BREAK = "\u2011"  # a non-breaking hyphen, while click wraps


def _glued(text: str) -> str:
    return text.replace("-", _NO_BREAK)


class _Formatter(click.HelpFormatter):
    """Help wrapped at spaces only: click's wrapping also breaks at hyphens, which split
    option and unit names across lines (`--gpu-` / `memory`)."""

    def write_text(self, text: str) -> None:
        super().write_text(_glued(text))

    def write_dl(self, rows: Any, col_max: int = 30, col_spacing: int = 2) -> None:
        super().write_dl([(_glued(a), _glued(b)) for a, b in rows], col_max, col_spacing)

    def write_usage(self, prog: str, args: str = "", prefix: str | None = None) -> None:
        super().write_usage(prog, _glued(args), prefix)

    def write(self, string: str) -> None:
        super().write(string.replace(_NO_BREAK, "-"))


class _Context(click.Context):
    """A usage error raised while this command's arguments are parsed names this command:
    click's parser raises some (an option missing its value) without a context, and the
    hint then lost the command path (`nodeagent: ... (see 'nodeagent --help')`). Its help
    is wrapped at spaces only (_Formatter)."""

    formatter_class = _Formatter

    def __exit__(self, *exc: Any) -> None:
        error = exc[1]
        if isinstance(error, click.UsageError) and error.ctx is None:
            error.ctx = self
        super().__exit__(*exc)


@click.group(
    # help at most 80 columns wide, narrower where the terminal is (every subcommand's too)
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 80},
    invoke_without_command=True,
    no_args_is_help=False,
)
@click.version_option(package_name="nodeagent")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Set cgroup v2 CPU and memory controls for this host's workloads from a policy file.

    \b
    Start here:
      nodeagent example-policy > policy.yaml   start a policy from the example
      nodeagent validate policy.yaml           check a policy file
      nodeagent workloads --config FILE        what discovery finds, which rule
                                               claims it
      nodeagent run --config FILE --dry-run    print the plan, write nothing
      nodeagent run --config FILE              the daemon (root, cgroup v2)
      nodeagent status                         what runs, and what is wrong
      nodeagent reload                         the daemon re-reads its policy
      nodeagent allocations                    what the daemon set, and why
      nodeagent explain CGROUP                 the policy trace of one workload
      nodeagent exec --deadline +2h --work 3h -- CMD
                                               CMD as a job, done by its deadline
      nodeagent gpus                           the GPUs, their health and users
      nodeagent capacity --arrival-rate L ...  replicas for a mean wait
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
    except click.ClickException as e:  # a policy file's problems, one FILE:LINE:COL a line
        _fail(e.format_message(), e.exit_code)
    except NodeagentError as e:
        _fail(str(e), 1)


def _fail(message: str, code: int) -> NoReturn:
    """`nodeagent: error: ...` on stderr (filed at priority err on the journal's stream), or
    with NODEAGENT_LOG_FORMAT=json the record, as every other line the unit writes."""
    from nodeagent.cli.output import report

    fmt = os.environ.get("NODEAGENT_LOG_FORMAT", "auto")
    report(fmt, "command.failed", f"nodeagent: error: {message}", level="error")
    sys.exit(code)
