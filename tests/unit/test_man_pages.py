"""nodeagent(8) and nodeagent-policy(5) as `man` shows them at 80 columns (issue 36, item 7):
no line past the margin, and nodeagent(8) has every command of the CLI with every option its
--help lists, and every word of its help text. The page once pasted each --help as a code
block: help wrapped at 80, indented 14 by man, lines of up to 94 columns; it is now built
from click's objects (docs/man/generate.py), so these checks are what keeps it whole.

The pages are rendered with debian/rules' own pandoc options and read with `man -l -`.
pandoc and man are needed: missing is a failure, not a skip (./scripts/test installs them,
scripts/lib.sh NODEAGENT_UNIT_APT_PACKAGES)."""

from __future__ import annotations

import inspect
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from nodeagent.cli import main

REPO = Path(__file__).resolve().parents[2]
PAGES = ("nodeagent.8", "nodeagent-policy.5")
COLUMNS = 80


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not on PATH: apt-get install {name}"
    return path


def _pandoc_options() -> list[str]:
    """The options debian/rules gives pandoc, up to --output: the page as the package has it."""
    rules = (REPO / "debian" / "rules").read_text()
    found = re.search(r"\bpandoc (--standalone [^\\\n]*)", rules)
    assert found is not None, "debian/rules: no `pandoc --standalone ...` line"
    return shlex.split(found.group(1))


def shown(page: str) -> str:
    """`man -l -` on the page's roff, as a reader at 80 columns sees it."""
    roff = subprocess.run(
        [_tool("pandoc"), *_pandoc_options(), str(REPO / "docs" / "man" / f"{page}.md")],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    ).stdout
    env = {k: v for k, v in os.environ.items() if k != "MAN_KEEP_FORMATTING"}
    env |= {"MANWIDTH": str(COLUMNS), "MANPAGER": "cat", "PAGER": "cat", "LC_ALL": "C.UTF-8"}
    text = subprocess.run(
        [_tool("man"), "-l", "-"],
        input=roff,
        check=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    ).stdout
    assert "\b" not in text, "man kept its overstrikes: not the text a reader sees"
    return text


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return {page: shown(page) for page in PAGES}


def commands() -> Iterator[tuple[tuple[str, ...], click.Command, click.Context]]:
    """Every command of the CLI (() is nodeagent itself), in the context click gives it: the
    help option is -h, --help from nodeagent's settings."""

    def walk(
        command: click.Command, path: tuple[str, ...], ctx: click.Context
    ) -> Iterator[tuple[tuple[str, ...], click.Command, click.Context]]:
        yield path, command, ctx
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                yield from walk(
                    sub, (*path, name), sub.context_class(sub, info_name=name, parent=ctx)
                )

    yield from walk(
        main, (), main.context_class(main, info_name="nodeagent", **main.context_settings)
    )


def sections(text: str) -> dict[str, list[str]]:
    """The page's lines by section and subsection title: a section's at column 0 (OPTIONS),
    a subsection's at 3 (nodeagent gpus place); the running head and foot left out."""
    found: dict[str, list[str]] = {}
    lines = text.splitlines()[1:-1]
    title = ""
    for line in lines:
        if re.match(r"(\S| {3}\S)", line):
            title = line.strip()
            assert title not in found, f"two sections {title!r}"
            found[title] = []
        elif title:
            found[title].append(line)
    return found


def words(text: str) -> list[str]:
    """The words of a text as man fills it: a word broken after its hyphen made one again,
    the shell's line continuations (\\) left out."""
    text = re.sub(r"(?<=\w-)\n\s*", "", text)
    return [word for word in text.split() if word != "\\"]


def first_missing(wanted: list[str], text: list[str]) -> str:
    """Where `text` stops having `wanted` in its order: that word and the next few, or ""."""
    rest = iter(text)
    for n, word in enumerate(wanted):
        if word not in rest:  # consumes `rest` up to the word: the order is checked
            return " ".join(wanted[n : n + 8])
    return ""


@pytest.mark.parametrize("page", PAGES)
def test_no_line_is_wider_than_80_columns(pages: dict[str, str], page: str) -> None:
    wide = [
        f"{n}: {len(line)}: {line}"
        for n, line in enumerate(pages[page].splitlines(), 1)
        if len(line) > COLUMNS
    ]
    assert not wide, f"{page}: {len(wide)} lines wider than {COLUMNS}:\n" + "\n".join(wide)


def test_every_command_has_its_section_with_every_option(pages: dict[str, str]) -> None:
    """Each option as click's help names it (`-c, --config FILE`), at the start of an entry of
    its command's list; nodeagent's own under OPTIONS; a group's commands under it too."""
    found = sections(pages["nodeagent.8"])
    problems = []
    for path, command, ctx in commands():
        title = f"nodeagent {' '.join(path)}" if path else "OPTIONS"
        if title not in found:
            problems.append(f"no section {title!r}")
            continue
        lines = found[title]
        usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
        if path and usage not in (line.strip() for line in lines):
            problems.append(f"{title}: no usage line {usage!r}")
        entries = [line[7:] for line in lines if re.match(r" {7}\S", line)]
        for param in command.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is None:
                continue
            if not any(re.match(re.escape(record[0]) + r"( |$)", entry) for entry in entries):
                problems.append(f"{title}: no entry {record[0]!r}")
        if isinstance(command, click.Group):
            listed = found["COMMANDS"] if not path else lines
            for name in command.list_commands(ctx):
                if not any(re.match(rf" {{7}}{re.escape(name)}( |$)", line) for line in listed):
                    problems.append(f"{title}: {name} not among its commands")
    assert not problems, "\n".join(problems)


def test_every_word_of_every_help_is_in_the_page(pages: dict[str, str]) -> None:
    """The help text, each option's help and the epilog, word for word and in order: text
    filled by man, examples whose explanation went under the command or that were folded
    (generate.py) still say all that --help says."""
    found = sections(pages["nodeagent.8"])
    problems = []
    for path, command, ctx in commands():
        title = f"nodeagent {' '.join(path)}" if path else "DESCRIPTION"
        said = words("\n".join(found.get(title, [])))
        texts = [
            inspect.cleandoc(command.help or "").partition("\f")[0],
            *[
                record[1]
                for param in command.get_params(ctx)
                if isinstance(param, click.Option) and path
                for record in [param.get_help_record(ctx)]
                if record is not None
            ],
            inspect.cleandoc(command.epilog or ""),
        ]
        missing = first_missing(words("\n".join(texts).replace("\b", "")), said)
        if missing:
            problems.append(f"{title}: from {missing!r} on, not in the page")
    assert not problems, "\n".join(problems)
