"""The repository's words stand alone: what it cites, it holds.

A reader of a clone has only the clone. So no file names a document that lives
outside it (a design note, a runbook or a peer-notes file kept beside the
checkout, or a path on the machine it was written on); every `docs/*.md` path
named anywhere exists; every relative link in the README and in docs/ leads to
a file; the README stays short enough to read first (the rest is in docs/),
and the words there state what is true now, with the history left to git.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("src", "tests", "bench", "examples", "deploy", "docs")
README = ROOT / "README.md"
README_MAX_LINES = 250

# Documents that exist only outside a clone unless a file of that name is added to it,
# and paths that can only point outside it.
DOCUMENT_NAMES = ("DESIGN.md", "INCIDENT.md", "PEERS.md", "STYLE.md")
OUTSIDE_PATHS = ("../shared", "/work/")
# This file names them in order to look for them.
SELF = Path(__file__).resolve()

DOCS_PATH = re.compile(r"\bdocs/[A-Za-z0-9_.-]+\.md\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HISTORY = re.compile(r"\bstop \d+\b", re.IGNORECASE)


def text_files() -> Iterator[tuple[Path, str]]:
    """Every text file the checks read: the README and each file under SCANNED."""
    paths = [README]
    for folder in SCANNED:
        if (ROOT / folder).is_dir():
            paths += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file())
    for path in paths:
        if path.resolve() == SELF or any(built(part) for part in path.parts):
            continue
        try:
            yield path, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a built kernel or other binary: it cites nothing


def built(part: str) -> bool:
    """A folder the build or the interpreter writes (ignored by git): not the project's words."""
    return part == "__pycache__" or part.endswith(".egg-info")


def docs_in_repo() -> set[str]:
    """Names of the documents a clone holds: at its root and in docs/."""
    return {p.name for p in ROOT.glob("*.md")} | {p.name for p in ROOT.glob("docs/*.md")}


def outside_citations() -> list[str]:
    held = docs_in_repo()
    missing = [name for name in DOCUMENT_NAMES if name not in held]
    found = []
    for path, text in text_files():
        for lineno, line in enumerate(text.splitlines(), 1):
            for name in (*missing, *OUTSIDE_PATHS):
                if name in line:
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: names {name}")
    return found


def test_no_file_names_a_document_outside_the_repository() -> None:
    found = outside_citations()
    assert not found, "cite a document in the repository (docs/) instead:\n" + "\n".join(found)


def test_every_cited_docs_path_exists() -> None:
    missing = [
        f"{path.relative_to(ROOT)}: {cited}"
        for path, text in text_files()
        for cited in sorted(set(DOCS_PATH.findall(text)))
        if not (ROOT / cited).is_file()
    ]
    assert not missing, "cited docs that do not exist:\n" + "\n".join(missing)


def markdown_pages() -> list[Path]:
    return [README, *sorted(ROOT.glob("docs/*.md"))]


def anchors(page: Path) -> set[str]:
    """The anchors a renderer gives the page's headings: lower case, punctuation dropped,
    spaces as hyphens."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_relative_links_in_readme_and_docs_lead_to_files_and_headings() -> None:
    broken = []
    for page in markdown_pages():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = page.parent / path if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_readme_is_short_and_the_docs_carry_no_history() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, over {README_MAX_LINES}: move detail into docs/"
    )
    dated = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for page in markdown_pages()
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        for m in HISTORY.finditer(line)
    ]
    assert not dated, "history belongs in git, not in the docs:\n" + "\n".join(dated)
