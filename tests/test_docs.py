"""The docs hold together: every relative link in README.md and docs/*.md names a file that
exists (and a heading there, for a link with an anchor), and every `$ slackswap ...` command they show is a real command with real options."""
import re
import shlex
from pathlib import Path

import pytest
import typer.main

from slackswap_cli.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(doc: Path):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor in the same page
        yield target


def shown_commands(doc: Path):
    for line in doc.read_text().splitlines():
        line = line.strip()
        if line.startswith("$ slackswap "):
            yield shlex.split(line[2:].split("  #")[0])


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_point_to_files(doc):
    missing = [t for t in relative_links(doc) if not (doc.parent / t.split("#")[0]).exists()]
    assert not missing, f"{doc.name} links to files that do not exist: {missing}"


def heading_anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (fenced code blocks left out)."""
    anchors, fenced = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_anchors_name_headings(doc):
    """A link to page.md#anchor (or #anchor in the page) names a heading that page has: a
    section moved to another page takes its links along."""
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        page, anchor = target.split("#", 1)
        page = (doc.parent / page) if page else doc
        if page.suffix == ".md" and page.exists() and anchor not in heading_anchors(page):
            broken.append(target)
    assert not broken, f"{doc.name} links to headings that do not exist: {broken}"


def test_the_readme_links_every_doc():
    linked = {(ROOT / t.split("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    assert {p.resolve() for p in DOCS[1:]} <= linked


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_shown_are_real(doc):
    group = typer.main.get_command(app)
    for argv in shown_commands(doc):
        name, args = argv[1], argv[2:]
        assert name in group.commands, f"{doc.name}: no command {name!r}: {shlex.join(argv)}"
        options = {o for p in group.commands[name].params for o in p.opts}
        unknown = [a.split("=")[0] for a in args if a.startswith("-") and a.split("=")[0] not in options]
        assert not unknown, f"{doc.name}: {name} has no option {unknown}: {shlex.join(argv)}"


def test_the_readme_shows_commands():
    assert len(list(shown_commands(ROOT / "README.md"))) >= 8
