"""The purity rule of nodeagent/policy (no I/O, no clock, no randomness) is a lint error.

Each case lints a probe module as if it lived in nodeagent/policy, through ruff's
stdin mode, so the folder's own ruff.toml is what is being tested.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
POLICY_DIR = REPO / "nodeagent" / "policy"


def ruff_command() -> list[str]:
    beside = Path(sys.executable).parent / "ruff"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    return [found] if found else [sys.executable, "-m", "ruff"]


def lint(source: str, filename: str) -> tuple[int, list[dict[str, object]]]:
    """Ruff's exit status and findings for `source` placed at `filename` (repo-relative)."""
    proc = subprocess.run(
        [
            *ruff_command(),
            "check",
            "--no-cache",
            "--output-format",
            "json",
            "--stdin-filename",
            filename,
            "-",
        ],
        input=source,
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout or "[]")


def codes_by_line(findings: list[dict[str, object]]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for f in findings:
        location = f["location"]
        assert isinstance(location, dict)
        out.setdefault(int(location["row"]), set()).add(str(f["code"]))
    return out


IMPURE = """\
import os
import time


def now_and_pid() -> tuple[float, int]:
    print("deciding")
    with open("/sys/fs/cgroup/cpu.max") as f:
        f.read()
    return time.time(), os.getpid()
"""


def test_io_and_clock_are_lint_errors_inside_the_policy_package() -> None:
    status, findings = lint(IMPURE, "nodeagent/policy/_probe.py")
    assert status == 1
    by_line = codes_by_line(findings)
    assert "TID251" in by_line[1]  # import os
    assert "TID251" in by_line[2]  # import time
    assert "T201" in by_line[6]  # print
    assert "PTH123" in by_line[7]  # open()
    messages = " ".join(str(f["message"]) for f in findings)
    assert "policies never read the clock" in messages
    assert "policies do no I/O" in messages


def test_the_same_source_is_allowed_outside_the_policy_package() -> None:
    _, findings = lint(IMPURE, "nodeagent/_probe.py")
    codes = {str(f["code"]) for f in findings}
    assert "TID251" not in codes
    assert "T201" not in codes


def test_global_state_is_a_lint_error() -> None:
    source = "COUNT = 0\n\n\ndef bump() -> None:\n    global COUNT\n    COUNT += 1\n"
    status, findings = lint(source, "nodeagent/policy/_probe.py")
    assert status == 1
    assert "PLW0603" in {str(f["code"]) for f in findings}


BANNED = [
    # the clock, in every spelling
    "import time",
    "import time as t",
    "from time import monotonic",
    "from datetime import datetime",
    # files, processes and sockets
    "import os",
    "import os.path",
    "from os import path",
    "from os.path import join",
    "import io",
    "import pathlib",
    "from pathlib import Path",
    "import shutil",
    "import socket",
    "import subprocess",
    # randomness, shared state, other layers
    "from random import random",
    "import threading",
    "import psutil",
    "import yaml",
    "import structlog",
    "import nodeagent.cgroupfs.tree",
    "from nodeagent.cgroupfs import tree",
    "from nodeagent.cgroupfs.tree import CgroupTree",
    "from nodeagent.sense.sensor import Sensor",
    "from nodeagent import sense",
]

# Modules that do I/O, read the clock or are random as surely as those above, but that the
# ban list does not name: a policy can import them and the lint stays green.
ALSO_IMPURE_STDLIB = [
    "import sys",  # sys.stdout.write, sys.stdin
    "import importlib",  # importlib.import_module('time') sidesteps every ban
    "import tempfile",
    "import glob",
    "import logging",  # the same reason structlog is banned
    "import secrets",
    "import uuid",  # uuid.uuid4() is random, uuid.uuid1() reads the clock
]
ALSO_IMPURE_NODEAGENT = [
    "from nodeagent.act import Executor",  # writes cgroup files
    "from nodeagent import state",  # writes the state file
    "from nodeagent.cgroupfs.detect import detect",  # reads /proc
    "from nodeagent.discovery.scan import scan",  # walks the cgroup tree
    "from nodeagent.policyfile.load import load_policy",  # reads the policy file
    "from nodeagent.api import client",  # talks to a socket
]


def unflagged(imports: list[str]) -> list[str]:
    """The imports among `imports` that ruff does not flag with TID251 in the policy package."""
    source = "".join(f"{line}  # noqa: F401\n" for line in imports)
    _, findings = lint(source, "nodeagent/policy/_probe.py")
    flagged = {row for row, codes in codes_by_line(findings).items() if "TID251" in codes}
    return [line for row, line in enumerate(imports, start=1) if row not in flagged]


def test_every_spelling_of_a_banned_module_is_flagged() -> None:
    assert unflagged(BANNED) == []


def test_other_stdlib_io_clock_and_randomness_is_banned_too() -> None:
    assert unflagged(ALSO_IMPURE_STDLIB) == []


def test_nodeagents_own_io_modules_are_banned_too() -> None:
    assert unflagged(ALSO_IMPURE_NODEAGENT) == []


@pytest.mark.parametrize(
    "module", sorted(p.name for p in POLICY_DIR.glob("*.py")), ids=lambda name: name
)
def test_policy_modules_pass_as_they_are(module: str) -> None:
    source = (POLICY_DIR / module).read_text()
    status, findings = lint(source, f"nodeagent/policy/{module}")
    assert (status, findings) == (0, [])


def test_the_whole_policy_package_passes() -> None:
    proc = subprocess.run(
        [*ruff_command(), "check", "--no-cache", "nodeagent/policy"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("folder", ["scripts/benchref", "nodeagent/gpualloc/placement"])
def test_what_left_the_policy_folder_keeps_its_bans(folder: str) -> None:
    """scripts/benchref/ (the deadline simulation, the baseline GPU allocators) left
    nodeagent/policy/ only to leave the installed package, and GPU placement to sit beside
    the ledger, its caller (issue 37): each one's ruff.toml extends the bans."""
    status, findings = lint(IMPURE, f"{folder}/_probe.py")
    assert status == 1
    assert {"TID251", "T201", "PTH123"} <= {str(f["code"]) for f in findings}
    proc = subprocess.run(
        [*ruff_command(), "check", "--no-cache", folder],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
