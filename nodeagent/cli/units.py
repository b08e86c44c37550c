"""`nodeagent unit`: the systemd units for this install, with ExecStart= pointing at it."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

import click

from nodeagent.errors import NodeagentError

TEMPLATE_EXECUTABLE = "/opt/nodeagent/.venv/bin/nodeagent"
"""What systemd/nodeagent.service names; docs/service.md's install, where it is right as shipped."""
# install path (below the unit directory) -> the packaged file (nodeagent/units/, links to systemd/)
FILES = {
    "nodeagent.service": "nodeagent.service",
    "nodeagent-workloads.service": "nodeagent-workloads.service",
    "system.slice.d/10-nodeagent.conf": "system.slice.d-10-nodeagent.conf",
    "nodeagent.service.d/metrics.conf": "nodeagent.service.d-metrics.conf",
}
OPTIONAL = {"nodeagent.service.d/metrics.conf"}
_SAFE_PATH = re.compile(r"/[A-Za-z0-9/._@+-]+")  # nothing systemd would expand or split


def installed_executable() -> str:
    """The `nodeagent` console script of the running install: beside this Python (a venv's
    bin/, not resolved: its python is a link out of the venv), else argv[0]."""
    beside = Path(sys.executable).parent / "nodeagent"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside.absolute())
    argv0 = Path(sys.argv[0])
    if argv0.name == "nodeagent" and argv0.is_file():
        return str(argv0.resolve())
    raise NodeagentError(
        f"cannot tell where the nodeagent command is (not beside {sys.executable}):"
        " pass --executable PATH"
    )


def render(name: str, executable: str) -> str:
    """The shipped file `name` (a key of FILES) with `executable` in ExecStart= and the rest."""
    if not _SAFE_PATH.fullmatch(executable) or "/../" in executable:
        raise NodeagentError(
            f"--executable {executable!r}: use an absolute path of letters, digits and"
            " '/._@+-' (systemd would expand or split others)"
        )
    text = (resources.files("nodeagent") / "units" / FILES[name]).read_text(encoding="utf-8")
    return text.replace(TEMPLATE_EXECUTABLE, executable)


def _write(path: Path, text: str) -> str:
    existed = path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return "replaced" if existed else "wrote"


@click.command()
@click.argument(
    "name", type=click.Choice(sorted(FILES)), default="nodeagent.service", metavar="[NAME]"
)
@click.option(
    "--executable",
    metavar="PATH",
    help="The nodeagent command the units run (default: this one, beside its Python).",
)
@click.option("--install", is_flag=True, help="Write the units into --dir instead of printing.")
@click.option(
    "--dir",
    "unit_dir",
    default="/etc/systemd/system",
    show_default=True,
    metavar="DIR",
    help="Where --install writes.",
)
@click.option("--metrics", is_flag=True, help="--install also writes the metrics drop-in.")
def unit(name: str, executable: str | None, install: bool, unit_dir: str, metrics: bool) -> None:
    """Print the systemd unit NAME for this install, or --install them all.

    \b
    NAME (default: nodeagent.service):
      nodeagent.service, nodeagent-workloads.service,
      nodeagent.service.d/metrics.conf, system.slice.d/10-nodeagent.conf

    The shipped units (systemd/ in the source) name /opt/nodeagent/.venv/bin/nodeagent;
    these name the nodeagent you run this with, wherever it is installed. --install writes
    nodeagent.service, nodeagent-workloads.service (which holds the workloads, so that they
    outlive the agent's restarts) and the system.slice drop-in that makes the agent's
    MemoryMin= count, and with --metrics the drop-in that lets agent.metrics.listen work.

    \b
    Examples:
      nodeagent unit --install && systemctl daemon-reload
      systemctl enable --now nodeagent
      nodeagent unit > /etc/systemd/system/nodeagent.service
      nodeagent unit nodeagent.service.d/metrics.conf
    """
    exe = executable or installed_executable()
    if not install:
        click.echo(render(name, exe), nl=False)
        return
    for relative in FILES:
        if relative in OPTIONAL and not metrics:
            continue
        target = Path(unit_dir) / relative
        try:
            done = _write(target, render(relative, exe))
        except OSError as e:
            raise NodeagentError(f"cannot write {target}: {e.strerror or e}") from e
        click.echo(f"{done} {target}")
    click.echo(
        f"ExecStart= runs {exe}; next: systemctl daemon-reload && systemctl enable --now nodeagent"
    )
