"""Write docs/man/nodeagent.8.md from the commands' own --help and nodeagent-policy.5.md
from docs/policy.md. The roff is not made here: debian/rules renders these files with pandoc
at package build (execute_before_dh_installman, each table a list by docs/man/tables.lua),
so no roff is committed to drift; tests/unit/test_packaging.py runs that recipe.

    python docs/man/generate.py          # from the repository root, with nodeagent importable
"""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from nodeagent.cli import main

MAN = Path(__file__).resolve().parent
_LINK = r"\[((?:[^\[\]\n]|\[[^\]\n]*\])+)\]\([^)\s]+\)"  # [text](target), text with `x[]` too
DOCS = MAN.parent
COMMANDS = [
    ["validate"],
    ["example-policy"],
    ["run"],
    ["status"],
    ["reload"],
    ["workloads"],
    ["allocations"],
    ["explain"],
    ["exec"],
    ["gpus"],
    ["gpus", "place"],
    ["gpus", "reserve"],
    ["gpus", "attach"],
    ["gpus", "release"],
    ["release"],
    ["unit"],
    ["capacity"],
]


def help_text(path: list[str]) -> str:
    """What `nodeagent PATH --help` prints, at 80 columns."""
    result = CliRunner().invoke(
        main, [*path, "--help"], prog_name="nodeagent", terminal_width=80, env={"NO_COLOR": "1"}
    )
    assert result.exit_code == 0, result.output
    return result.output


def manual_8() -> str:
    top = help_text([])
    out = [
        "% NODEAGENT(8) nodeagent | System Manager's Manual",
        "",
        "# NAME",
        "",
        "nodeagent - cgroup v2 CPU, memory and GPU policy for the workloads of a Linux AI host",
        "",
        "# SYNOPSIS",
        "",
        "**nodeagent** [**--version**] [**--help**] *COMMAND* [*OPTIONS*] [*ARGS*]...",
        "",
        "# DESCRIPTION",
        "",
        "**nodeagent** is a per-host daemon (**nodeagent run**) and the commands that ask it",
        "what it set and why. It finds the workloads' cgroups (Docker, containerd, CRI-O and",
        "podman containers, Kubernetes pods, systemd services, Slurm jobs and its own jobs) and",
        "on every tick sets their `cpu.weight`, `cpu.max`, `memory.max`, `memory.high`,",
        "`memory.min`/`memory.low` and `cgroup.freeze` from the policy file described in",
        "**nodeagent-policy**(5). The text below is each command's own `--help`.",
        "",
        "```",
        top.rstrip(),
        "```",
        "",
        "# COMMANDS",
        "",
    ]
    for path in COMMANDS:
        out += [f"## nodeagent {' '.join(path)}", "", "```", help_text(path).rstrip(), "```", ""]
    out += [
        "# FILES",
        "",
        "*/etc/nodeagent/policy.yaml*",
        ":   The policy the shipped unit runs with; see **nodeagent-policy**(5).",
        "",
        "*/run/nodeagent/nodeagent.sock*",
        ":   The API socket (`agent.socket`), mode 0660: root and `agent.socket_group`.",
        "",
        "*/var/lib/nodeagent/state.json*",
        ":   The state file (`agent.state_file`): usage history, jobs, GPU holds, and what",
        "    **nodeagent release** hands back. Written atomically every 10 s and on exit.",
        "",
        "*/etc/systemd/system/nodeagent.service*, *nodeagent-workloads.service*",
        ":   The units **nodeagent unit --install** writes.",
        "",
        "# ENVIRONMENT",
        "",
        "`NODEAGENT_SOCKET`",
        ":   The API socket the client commands use (default */run/nodeagent/nodeagent.sock*).",
        "",
        "`NODEAGENT_GPU_SIM`",
        ":   A simulated GPU node (a YAML file, see *config/gpus/*) instead of NVML.",
        "",
        "`NO_COLOR`",
        ":   Turns off any style in the output.",
        "",
        "# SIGNALS",
        "",
        "**SIGHUP**",
        ":   **nodeagent run** reloads the policy file, as **nodeagent reload** has it do; a",
        "    file that does not validate is logged (`policy.invalid`) and the last good policy",
        "    stays in force.",
        "",
        "**SIGTERM**, **SIGINT**",
        ":   **nodeagent run** stops: the state file is saved, workloads keep running.",
        "",
        "**nodeagent exec** passes SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to CMD.",
        "",
        "# EXIT STATUS",
        "",
        "**0**",
        ":   Success.",
        "",
        "**1**",
        ":   An error, said in one line (`nodeagent: error: ...`): an invalid policy, no daemon",
        "    answering, a host without cgroup v2 cpu and memory, nothing fits (**gpus place**),",
        "    an unstable queue (**capacity**), a policy the daemon refused (**reload**), problems",
        "    the daemon lists (**status**).",
        "",
        "**2**",
        ":   A usage error: a bad option or a missing value, one line naming the command.",
        "",
        "**130**",
        ":   Interrupted.",
        "",
        "**nodeagent exec** exits with CMD's status (128+N when CMD is killed by signal N).",
        "",
        "# SEE ALSO",
        "",
        "**nodeagent-policy**(5), **systemd.unit**(5), **systemd.resource-control**(5),",
        "**systemctl**(1), **journalctl**(1); *README.md* and *docs/* in the source:",
        "*docs/commands.md*, *docs/service.md*, *docs/architecture.md*.",
        "",
    ]
    return "\n".join(out)


def manual_5() -> str:
    policy = (DOCS / "policy.md").read_text()
    intro, _, keys = policy.partition("\n## Top level\n")
    intro = intro.split("\n", 2)[2].strip()  # without the title
    keys = "## Top level\n" + keys
    keys, intro = (re.sub(_LINK, r"\1", text) for text in (keys, intro))  # no links in a man page
    example = (DOCS.parent / "config" / "policy.yaml").read_text()
    return "\n".join(
        [
            "% NODEAGENT-POLICY(5) nodeagent | File Formats Manual",
            "",
            "# NAME",
            "",
            "nodeagent-policy - the policy file of nodeagent(8)",
            "",
            "# SYNOPSIS",
            "",
            "*/etc/nodeagent/policy.yaml*",
            "",
            "# DESCRIPTION",
            "",
            intro,
            "",
            "Check a file with **nodeagent validate** *FILE*; print the example this install",
            "carries with **nodeagent example-policy**.",
            "",
            "# KEYS",
            "",
            keys.strip(),
            "",
            "# EXAMPLES",
            "",
            "The smallest useful policy: two tenants sharing the node 2:1, Docker containers",
            "for one, *nodeagent exec*'s jobs for the other.",
            "",
            "```yaml",
            "version: 1",
            "agent:",
            "  managed_root: system.slice/nodeagent-workloads.service/workloads",
            "tenants:",
            "  research: {shares: 2}",
            "  prod: {shares: 1}",
            "jobs:",
            "  default_tenant: research",
            "rules:",
            "  - name: docker",
            "    match: {runtime: docker}",
            "    tenant: prod",
            "    class: inference",
            "    limits: {memory_max: 8Gi}",
            "```",
            "",
            "The example shipped as *config/policy.yaml* (**nodeagent example-policy**):",
            "",
            "```yaml",
            example.rstrip(),
            "```",
            "",
            "# FILES",
            "",
            "*/etc/nodeagent/policy.yaml*",
            ":   The file the shipped unit reads (a conffile of the Debian package).",
            "",
            "# SEE ALSO",
            "",
            "**nodeagent**(8); *docs/policy.md* in the source.",
            "",
        ]
    )


def main_() -> None:
    pages = {"nodeagent.8": manual_8(), "nodeagent-policy.5": manual_5()}
    for name, text in pages.items():
        (MAN / f"{name}.md").write_text(text)
    print("wrote", ", ".join(f"docs/man/{name}.md" for name in pages))
    print("roff: made by debian/rules at package build; to read a page as it will be:")
    print("  pandoc -s -f markdown-smart -t man -L docs/man/tables.lua \\")
    print("    docs/man/nodeagent.8.md | man -l -")


if __name__ == "__main__":
    main_()
