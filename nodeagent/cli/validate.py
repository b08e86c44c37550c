"""`nodeagent validate`: every problem in a policy file, in one round."""

from __future__ import annotations

import sys

import click

from nodeagent.cli.output import counted


@click.command()
@click.argument("file", type=click.Path(dir_okay=True))
@click.option("--strict", is_flag=True, help="Fail (exit 1) on warnings too.")
def validate(file: str, strict: bool) -> None:
    """Check a policy FILE; print FILE:LINE:COL: message for every problem.

    Every problem is found in one round: a field with a type error does not hide
    the unknown tenant, the duplicate rule or the bad limit elsewhere. Warnings
    (FILE:LINE:COL: warning: ...) are for what is valid but almost surely not
    meant: a policy without rules, a rule that never applies because an earlier
    one matches everything it matches.

    Exits 0 when the file is valid (warnings or not, unless --strict), 1 otherwise.
    """
    from nodeagent.spec.load import PolicyError, check_policy

    try:
        checked = check_policy(file)
    except PolicyError as e:
        problems = sorted((*e.problems, *e.warnings), key=lambda p: (p.line, p.col))
        lines = [str(p) for p in problems]
        if e.omitted:
            lines.append(f"{file}: ... and {e.omitted} more problems")
        click.echo("\n".join(lines), err=True)
        sys.exit(1)
    for warning in checked.warnings:
        click.echo(str(warning), err=True)
    if strict and checked.warnings:
        sys.exit(1)
    spec, warned = checked.spec, len(checked.warnings)
    found = f"{counted(len(spec.tenants), 'tenant')}, {counted(len(spec.rules), 'rule')}"
    click.echo(f"{file}: ok ({found}" + (f"; {counted(warned, 'warning')})" if warned else ")"))
