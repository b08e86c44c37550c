"""What the packages carry, checked without building them (./scripts/package builds them):
the wheel's data are the files in config/ and systemd/, `nodeagent example-policy` prints
the example, the Debian package's version and unit template agree with the sources, and
the licence is the one pyproject.toml names."""

from __future__ import annotations

import re
import tomllib
from importlib import resources
from pathlib import Path

from click.testing import CliRunner

from nodeagent import __version__
from nodeagent.cli import main

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DATA = {
    "nodeagent/data/policy.yaml": "config/policy.yaml",
    "nodeagent/data/grafana-dashboard.json": "config/grafana/nodeagent.json",
    "nodeagent/data/prometheus-alerts.yaml": "config/prometheus/nodeagent-alerts.yaml",
    "nodeagent/units/nodeagent.service": "systemd/nodeagent.service",
}


def test_the_packaged_data_are_the_sources_files() -> None:
    """Links, so that the wheel copies the very files the docs and the tests use."""
    for packaged, source in DATA.items():
        link = REPO / packaged
        assert link.is_symlink(), f"{packaged} must link to {source}"
        assert link.resolve() == (REPO / source).resolve()
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["nodeagent"]
    for packaged in DATA:
        relative = packaged.removeprefix("nodeagent/")
        assert any(Path(relative).match(g) for g in globs), f"{relative} is not package data"


def test_example_policy_prints_the_example_this_install_carries() -> None:
    result = CliRunner().invoke(main, ["example-policy"])
    assert result.exit_code == 0, result.output
    assert result.stdout == (REPO / "config/policy.yaml").read_text()
    carried = resources.files("nodeagent") / "data" / "policy.yaml"
    assert carried.read_text() == result.stdout


def test_the_debian_package_is_at_the_projects_version() -> None:
    first = (REPO / "debian/changelog").read_text().splitlines()[0]
    assert first.startswith(f"nodeagent ({PYPROJECT['project']['version']}) ")
    assert PYPROJECT["project"]["version"] == __version__


def test_the_debian_unit_is_the_shipped_one_with_the_packages_command() -> None:
    """debian/rules rewrites the shipped unit's command to the package's: the path it
    replaces must be the one the unit names."""
    rules = (REPO / "debian/rules").read_text()
    template = re.search(r"^TEMPLATE_EXECUTABLE := (\S+)$", rules, re.M)
    assert template is not None
    unit = (REPO / "systemd/nodeagent.service").read_text()
    assert f"ExecStart={template.group(1)} run " in unit
    assert "--no-enable --no-start" in rules, "an example policy is never started unasked"


def test_the_licence_is_the_one_pyproject_names() -> None:
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_what_the_unit_runs_is_in_the_packages_dependencies() -> None:
    """systemd-analyze verify fails on a command that is not there: /bin/kill (ExecReload=)
    is procps's, which a minimal Debian lacks."""
    unit = (REPO / "systemd/nodeagent.service").read_text()
    control = (REPO / "debian/control").read_text()
    commands = set(re.findall(r"^Exec\w+=[-@:+!]*(\S+)", unit, re.M))
    providers = {"/bin/kill": "procps"}
    for command in commands - {"/opt/nodeagent/.venv/bin/nodeagent"}:
        assert command in providers, f"{command}: which package gives it?"
        assert re.search(rf"^\s+{providers[command]},$", control, re.M), providers[command]
