"""`nodeagent validate`: every problem in a policy file, in one round."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from nodeagent.cli.common import json_option, log_format_option
from nodeagent.cli.output import counted, document, echo_json, report

if TYPE_CHECKING:
    from nodeagent.policyfile.yamlfile import Problem


@click.command()
@click.argument("file", type=click.Path(dir_okay=True))
@click.option("--strict", is_flag=True, help="Fail (exit 1) on warnings too.")
@json_option
@log_format_option
def validate(file: str, strict: bool, as_json: bool, log_format: str) -> None:
    """Check a policy FILE; print FILE:LINE:COL: message for every problem.

    Every problem is found in one round: a field with a type error does not hide
    the unknown tenant, the duplicate rule or the bad limit elsewhere. Warnings
    (FILE:LINE:COL: warning: ...) are for what is valid but almost surely not
    meant: a policy without rules, a rule that never applies because an earlier
    one matches everything it matches.

    Exits 0 when the file is valid (warnings or not, unless --strict), 1 otherwise.
    With --json, the same as one JSON object (kind PolicyCheck) on stdout.
    """
    from nodeagent.cli.run import metrics_refused
    from nodeagent.policyfile.load import check_policy
    from nodeagent.policyfile.yamlfile import PolicyError

    spec = None
    try:
        checked = check_policy(file)
    except PolicyError as e:
        problems, omitted = sorted((*e.problems, *e.warnings), key=_where), e.omitted
    else:
        spec, problems, omitted = checked.spec, list(checked.warnings), 0
    refused = None if spec is None else metrics_refused(spec.agent.metrics.listen)
    failed = spec is None or refused is not None or (strict and bool(problems))
    if as_json:
        doc = _check_document(file, not failed, spec, problems, omitted)
        if refused is not None:  # not at a line: the file is valid, this process cannot serve it
            doc["problems"].append(
                {"line": None, "column": None, "severity": "error", "message": refused}
            )
        echo_json(doc)
    else:
        # as ExecStartPre=, each problem is filed at its journald priority (err, or warning),
        # so `journalctl -p err -u nodeagent` shows it
        for p in problems:
            error = p.severity == "error"
            report(
                log_format,
                "policy.invalid" if error else "policy.warning",
                str(p),
                level="error" if error else "warning",
                file=file,
                line=p.line,
                column=p.col,
                problem=p.message,
            )
        if omitted:
            text = f"{file}: ... and {omitted} more problems"
            report(log_format, "policy.invalid", text, level="error", file=file, omitted=omitted)
        if refused is not None:
            report(log_format, "policy.refused", f"{file}: {refused}", level="error", file=file)
        if spec is not None and not failed:
            found = f"{counted(len(spec.tenants), 'tenant')}, {counted(len(spec.rules), 'rule')}"
            warned = f"; {counted(len(problems), 'warning')}" if problems else ""
            report(
                log_format,
                "policy.valid",
                f"{file}: ok ({found}{warned})",
                file=file,
                tenants=len(spec.tenants),
                rules=len(spec.rules),
                warnings=len(problems),
            )
    if failed:
        sys.exit(1)


def _where(p: Problem) -> tuple[int, int]:
    return p.line, p.col


def _check_document(
    file: str, valid: bool, spec: Any, problems: Sequence[Problem], omitted: int
) -> dict[str, Any]:
    from nodeagent.policyfile.load import digest

    return document(
        "PolicyCheck",
        {
            "file": file,
            "valid": valid,
            "tenants": None if spec is None else len(spec.tenants),
            "rules": None if spec is None else len(spec.rules),
            "sha256": None if spec is None else digest(spec),
            "problems": [
                {"line": p.line, "column": p.col, "severity": p.severity, "message": p.message}
                for p in problems
            ],
            "omitted_problems": omitted,
        },
    )
