"""Every relative link in README.md and docs/ leads to a file that exists and, with an
#anchor, to a heading there (GitHub's slugs: lower case, punctuation dropped, spaces to -)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_LINK = re.compile(r"\[(?:[^\[\]\n]|\n(?!\n)|\[[^\]\n]*\])*\]\(([^()\s]+)\)")  # text may wrap


def _outside_code(text: str) -> str:
    """The text without fenced blocks and inline code, where brackets are not links."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
    for heading in re.findall(r"(?m)^#{1,6} (.+?)\s*#*$", text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    return [
        target
        for target in _LINK.findall(_outside_code(path.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def test_the_slugs_are_githubs() -> None:
    assert slug("`--json`: the stable interface") == "--json-the-stable-interface"
    assert slug("`rules[].match`") == "rulesmatch"
    assert slug("Packages: wheel, Debian package, container image") == (
        "packages-wheel-debian-package-container-image"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(REPO)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_the_man_pages_are_what_generate_writes() -> None:
    """docs/man/*.md are made from the commands' --help and docs/policy.md: run
    docs/man/generate.py after changing either."""
    spec = importlib.util.spec_from_file_location("generate", REPO / "docs/man/generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert (REPO / "docs/man/nodeagent.8.md").read_text() == generate.manual_8()
    assert (REPO / "docs/man/nodeagent-policy.5.md").read_text() == generate.manual_5()
