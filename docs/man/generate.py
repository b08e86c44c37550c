"""Write docs/man/nodeagent.8.md from the commands' own --help and nodeagent-policy.5.md
from docs/policy.md. The roff is not made here: debian/rules renders these files with pandoc
at package build (execute_before_dh_installman, each table a list by docs/man/tables.lua),
so no roff is committed to drift; tests/unit/test_packaging.py runs that recipe.

Each command's section is built from click's own objects, as help2man builds a page: the
usage line, the help text's paragraphs as text that man fills to the reader's width, click's
no-rewrap (\\b) blocks as code blocks, and the options as a list (`--flag METAVAR`, then its
help with the default and range click shows). Pasting the rendered --help instead made lines
of 94 columns: help wrapped at 80, then indented 14 by man. A code block is never wrapped, so
each must fit VERBATIM: a two-column block that does not (a command, its explanation beside
it) has the explanation go under its command, a command that does not is folded with `\\`.
tests/unit/test_man_pages.py reads both pages at 80 columns.

    python docs/man/generate.py          # from the repository root, with nodeagent importable
"""

from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path

import click

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
"""The order of the COMMANDS section; every command of the CLI, no other (manual_8 checks)."""

VERBATIM = 80 - 14
"""The widest line of a code block that man shows whole at 80 columns: it indents a block by
14, the section's 7 and the block's own 7 (.IP), and never wraps one."""
WIDTH = 92  # of the Markdown's own lines, which pandoc joins again
SETTING = ["---", "hyphenate: false", "adjusting: l", "..."]
"""Both pages' metadata for pandoc's man template: no hyphenation (.nh), so that an option or
a key (--simulate, memory_max) is never broken where man fills text, where a reader searches
for it; ragged right (.ad l), so that a line with a long path is not stretched with gaps."""
_FOLD = 4  # a folded command's continuation lines, and an explanation under its command


def commands() -> dict[tuple[str, ...], tuple[click.Command, click.Context]]:
    """Every command of the CLI by its path (() is nodeagent itself), each with the context
    click gives it: the help option's names (-h, --help) come from nodeagent's settings."""
    found: dict[tuple[str, ...], tuple[click.Command, click.Context]] = {}

    def walk(command: click.Command, path: tuple[str, ...], ctx: click.Context) -> None:
        found[path] = (command, ctx)
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None, name
                walk(sub, (*path, name), sub.context_class(sub, info_name=name, parent=ctx))

    walk(main, (), main.context_class(main, info_name="nodeagent", **main.context_settings))
    return found


def _escaped(text: str) -> str:
    """`text` as Markdown that pandoc reads back as the very text: no emphasis, link, math,
    raw HTML (NODEAGENT_<KEY>), citation (@) or sub/superscript made of its characters."""
    text = re.sub(r"([\\`*_\[\]<>$@~^|&])", r"\\\1", text)
    # e.g. ends no sentence: a no-break space, which man does not widen as after a full stop
    return re.sub(r"\b(e\.g\.|i\.e\.) ", "\\1\u00a0", text)


def _line_start(line: str) -> str:
    """A Markdown line that begins with a list, heading, quote or definition marker begins
    one; escaped, it is text."""
    if re.match(r"[-+:#>=]", line):
        return "\\" + line
    return re.sub(r"^(\d+)([.)])", r"\1\\\2", line)


def _prose(text: str) -> list[str]:
    """A paragraph man fills to the reader's width."""
    lines = textwrap.wrap(_escaped(" ".join(text.split())), WIDTH, break_on_hyphens=False)
    return [*map(_line_start, lines), ""]


def _definition(term: str, text: str) -> list[str]:
    """An entry of a definition list: man sets `term`, then `text` indented under it."""
    body = textwrap.wrap(
        _escaped(" ".join(text.split())),
        WIDTH,
        initial_indent=":   ",
        subsequent_indent="    ",
        break_on_hyphens=False,
    )
    return [term, body[0], *("    " + _line_start(line[4:]) for line in body[1:]), ""]


def _code(lines: list[str]) -> list[str]:
    return ["```", *lines, "```", ""]


def _paragraphs(text: str) -> list[tuple[bool, list[str]]]:
    """click's paragraphs of a help text or epilog (up to a \\f), as click finds them: lines
    up to an empty one; (True, lines) for a no-rewrap block (\\b), its marker dropped."""
    found: list[tuple[bool, list[str]]] = []
    text = inspect.cleandoc(text).partition("\f")[0].strip("\n")
    for block in re.split(r"\n\n+", text) if text else []:
        lines = block.split("\n")
        kept = lines[0].strip() == "\b"
        found.append((kept, lines[1:] if kept else lines))
    return found


def _help_text(text: str | None) -> list[str]:
    """A help text: click's filled paragraphs as paragraphs; a \\b block's unindented lines
    (Examples:, a sentence about the commands) as a paragraph too, its indented lines (the
    commands) as a code block."""
    out: list[str] = []
    for kept, lines in _paragraphs(text or ""):
        if not kept:
            out += _prose(" ".join(lines))
            continue
        run: list[str] = []
        for line in [*lines, ""]:
            if run and (not line or line.startswith(" ") != run[0].startswith(" ")):
                if run[0].startswith(" "):
                    out += _code(_fitted(textwrap.dedent("\n".join(run)).split("\n")))
                else:
                    out += _prose(" ".join(run))
                run = []
            if line:
                run.append(line)
    return out


def _logical(lines: list[str]) -> list[list[str]]:
    """The lines of a code block grouped by the shell's lines: one ending in \\ goes on."""
    grouped: list[list[str]] = []
    for line in lines:
        if grouped and grouped[-1][-1].endswith("\\"):
            grouped[-1].append(line)
        else:
            grouped.append([line])
    return grouped


def _words(command: str) -> list[str]:
    """The words of a shell command, each option with its value: where a command may be
    folded (not inside quotes, not between an option and its value)."""
    words: list[str] = []
    quote = ""
    for token in command.split(" "):
        if quote or (words and not token.startswith("-") and words[-1].startswith("-")):
            words[-1] += " " + token
        elif token:
            words.append(token)
        for char in token:
            if char in "'\"" and quote in ("", char):
                quote = "" if quote else char
    return words


def _fold(command: str) -> list[str]:
    """A shell command in lines of at most VERBATIM, each but the last ending in \\."""
    lines: list[str] = []
    for word in _words(command):
        if lines and len(lines[-1]) + len(f" {word} \\") <= VERBATIM:
            lines[-1] += f" {word}"
        elif lines:
            lines[-1] += " \\"
            lines.append(" " * _FOLD + word)
        else:
            lines.append(word)
    return lines


def _fitted(lines: list[str]) -> list[str]:
    """A \\b block's commands, fitted to VERBATIM where a line is wider: a block of commands
    with their explanations beside them (in a second column) as each command, then its
    explanation on the next lines; a command too wide folded at its words."""
    if max(map(len, lines)) <= VERBATIM:
        return lines
    beside = [re.match(r"(\S.*?\S) {2,}(\S.*)$", line) for line in lines]
    column = min((m.start(2) for m in beside if m), default=0)
    out: list[str] = []
    if column:  # two columns: "command   explanation", the explanation maybe on more lines
        entries: list[list[str]] = []
        for line, m in zip(lines, beside, strict=True):
            if line[:column].strip() == "" and entries:
                entries[-1][1] = f"{entries[-1][1]} {line.strip()}".strip()
            else:
                entries.append([m.group(1), m.group(2)] if m else [line.rstrip(), ""])
        for command, explanation in entries:
            out += _fold(command) if len(command) > VERBATIM else [command]
            indent = " " * _FOLD
            out += textwrap.wrap(
                explanation,
                VERBATIM,
                initial_indent=indent,
                subsequent_indent=indent,
                break_on_hyphens=False,
            )
    else:
        for group in _logical(lines):
            if max(map(len, group)) <= VERBATIM:
                out += group
            else:
                out += _fold(" ".join(line.strip().removesuffix("\\").strip() for line in group))
    wide = [line for line in out if len(line) > VERBATIM]
    assert not wide, f"wider than {VERBATIM} in any layout: {wide}"
    return out


def _usage(command: click.Command, ctx: click.Context) -> list[str]:
    """click's usage line: the command in bold, each metavar (FILE, [OPTIONS]) in italics."""
    pieces = " ".join(command.collect_usage_pieces(ctx))
    styled = re.sub(r"[A-Z][A-Z0-9_]*(?:\\\|[A-Z][A-Z0-9_]*)*", r"*\g<0>*", _escaped(pieces))
    return [f"**{ctx.command_path}** {styled}", ""]


def _term(spec: str) -> str:
    """click's `-c, --config FILE` as `**-c**, **--config** *FILE*`."""
    out = []
    for part in re.split(r"(, | / |; )", spec):
        if part in (", ", " / ", "; "):
            out.append(part)
            continue
        name, _, metavar = part.partition(" ")
        out.append(f"**{_escaped(name)}**" + (f" *{_escaped(metavar)}*" if metavar else ""))
    return "".join(out)


def _options(command: click.Command, ctx: click.Context) -> list[str]:
    """The options as click lists them, its help record each: the spellings and the metavar,
    then the help with what click adds ([default: ...; 1<=x<=64], [required])."""
    out: list[str] = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
        if record is not None:
            out += _definition(_term(record[0]), record[1])
    return ["Options:", "", *out] if out else []


def _subcommands(command: click.Command, ctx: click.Context) -> list[str]:
    """A group's commands, each with its first sentence (click's short help, whole)."""
    if not isinstance(command, click.Group):
        return []
    out = ["Commands:", ""]
    for name in command.list_commands(ctx):
        sub = command.get_command(ctx, name)
        assert sub is not None, name
        out += _definition(f"**{_escaped(name)}**", sub.get_short_help_str(limit=1000))
    return out


def command_section(path: tuple[str, ...]) -> list[str]:
    """What `nodeagent PATH --help` says, as a page's subsection."""
    command, ctx = commands()[path]
    return [
        f"## {ctx.command_path}",
        "",
        *_usage(command, ctx),
        *_help_text(command.help),
        *_options(command, ctx),
        *_help_text(command.epilog),
        *_subcommands(command, ctx),
    ]


def manual_8() -> str:
    tree = commands()
    assert sorted(map(tuple, COMMANDS)) == sorted(tree.keys() - {()}), "COMMANDS: not the CLI's"
    command, ctx = tree[()]
    out = [
        "% NODEAGENT(8) nodeagent | System Manager's Manual",
        "",
        *SETTING,
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
        "**nodeagent-policy**(5). What follows is each command's own `--help`.",
        "",
        *_help_text(command.help),
        "# OPTIONS",
        "",
        *_options(command, ctx)[2:],  # the section's title says it
        "# COMMANDS",
        "",
        *_subcommands(command, ctx)[2:],
    ]
    for path in COMMANDS:
        out += command_section(tuple(path))
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
    return "\n".join(
        [
            "% NODEAGENT-POLICY(5) nodeagent | File Formats Manual",
            "",
            *SETTING,
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
            "The example the package installs as */etc/nodeagent/policy.yaml*, every key with",
            "its default and what it means, is what **nodeagent example-policy** prints",
            "(*config/policy.yaml* in the source); its comments are too wide for this page.",
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
