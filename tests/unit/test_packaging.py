"""What the packages carry, checked without building them (./scripts/package builds them):
the wheel's data are the files in config/ and systemd/, `nodeagent example-policy` prints
the example, the Debian package's version and unit template agree with the sources, and
the licence is the one pyproject.toml names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from importlib import resources
from pathlib import Path

import yaml
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


def test_the_debian_package_has_the_extras_the_shipped_kubernetes_policy_needs() -> None:
    """The container image is the Debian package; the DaemonSet's policy watches the API
    server, which needs the `kubernetes` extra: without it the shipped pod died at start
    with ModuleNotFoundError (found by ./scripts/test image, issue 35)."""
    policy = yaml.safe_load((REPO / "deploy/kubernetes/policy.yaml").read_text())
    assert policy["kubernetes"]["api_server"]["watch"] is True
    assert "kubernetes" in PYPROJECT["project"]["optional-dependencies"]
    rules = (REPO / "debian/rules").read_text()
    (call,) = re.findall(r"^\tdh_virtualenv (?:[^\n]*\\\n)*[^\n]*", rules, re.M)
    assert re.search(r"--extras[= ]kubernetes\b", call), call


MAN_PAGES = {"nodeagent.8": ("NODEAGENT", "8"), "nodeagent-policy.5": ("NODEAGENT-POLICY", "5")}


def _tool(name: str) -> str:
    """A tool these tests need: missing is a failure, not a skip (./scripts/test installs
    them, scripts/lib.sh NODEAGENT_UNIT_APT_PACKAGES)."""
    path = shutil.which(name)
    assert path, f"{name} is not on PATH: apt-get install {name}"
    return path


def test_debian_rules_makes_man_pages_that_man_renders_cleanly(tmp_path: Path) -> None:
    """The roff is made at package build, not committed: this runs debian/rules' own recipe
    (pandoc on docs/man/*.md) in a scratch tree and reads each page as `man` would at 80
    columns, where a warning (a table past the margin, a line that cannot break) fails."""
    make, man = _tool("make"), _tool("man")
    _tool("pandoc")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "man").symlink_to(REPO / "docs" / "man")
    made = subprocess.run(
        [
            make,
            "-s",
            "-C",
            str(tmp_path),
            "-f",
            str(REPO / "debian/rules"),
            "execute_before_dh_installman",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    env = {**os.environ, "MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat", "LC_ALL": "C.UTF-8"}
    for page, (title, section) in MAN_PAGES.items():
        roff = (tmp_path / "debian" / "man" / page).read_text()
        th = re.search(r'^\.TH "([^"]*)" "([^"]*)"', roff, re.M)
        assert th is not None and th.groups() == (title, section), page
        assert "\n.TS\n" not in roff, f"{page}: a table left (docs/man/tables.lua makes lists)"
        shown = subprocess.run(
            [man, "--warnings", "-l", str(tmp_path / "debian" / "man" / page)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert shown.returncode == 0 and shown.stderr == "", f"{page}:\n{shown.stderr}"
        assert shown.stdout.startswith(f"{title}({section})"), shown.stdout[:200]
        assert "\nNAME\n" in shown.stdout and "\nSEE ALSO\n" in shown.stdout
        if page == "nodeagent.8":  # pandoc's smart typography would make "--" a dash
            assert "nodeagent [--version] [--help] COMMAND" in shown.stdout


def test_the_debian_package_installs_both_man_pages() -> None:
    rules = (REPO / "debian/rules").read_text()
    listed = re.search(r"^MANPAGES := (.+)$", rules, re.M)
    assert listed is not None
    assert sorted(listed.group(1).split()) == sorted(MAN_PAGES)
    assert re.search(r"^execute_before_dh_installman:", rules, re.M)
    manpages = (REPO / "debian/nodeagent.manpages").read_text().split()
    assert manpages == [f"debian/man/{page}" for page in listed.group(1).split()]
    for page in MAN_PAGES:
        assert (REPO / "docs/man" / f"{page}.md").is_file()
    control = (REPO / "debian/control").read_text()
    build_depends = control.split("Build-Depends:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"^\s+pandoc\b", build_depends, re.M), "pandoc: a build dependency"
    package = (REPO / "scripts/package").read_text()
    assert re.search(r"^\s+apt_install .*\bpandoc\b", package, re.M), "build_deb installs pandoc"
    lib = (REPO / "scripts/lib.sh").read_text()
    unit_packages = re.search(r"^NODEAGENT_UNIT_APT_PACKAGES=\((.*)\)$", lib, re.M)
    assert unit_packages is not None
    assert {"pandoc", "make", "man-db"} <= set(unit_packages.group(1).split())


def test_each_lintian_override_says_why() -> None:
    """An override hides a tag from every later lintian run: each is one the dh-virtualenv
    layout makes by design, and the comment above it says so (docs/packages.md lists them)."""
    lines = (REPO / "debian/nodeagent.lintian-overrides").read_text().splitlines()
    overrides = [i for i, line in enumerate(lines) if line and not line.startswith("#")]
    assert overrides
    for i in overrides:
        assert lines[i].startswith("nodeagent: "), lines[i]
        above = i - 1
        while above >= 0 and lines[above].startswith("nodeagent: "):
            above -= 1
        assert above >= 0 and lines[above].startswith("# "), f"no comment: {lines[i]}"
    assert not any("no-manual-page" in line for line in lines), "the man pages are shipped"
