"""Every relative link in the README and in ``docs/`` reaches a file, and a heading where it names one.

The docs cross-reference each other by section (``guard.md#the-bound``); a section renamed or moved
to another page would otherwise leave links that land at the top of a page, or nowhere.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCED = re.compile(r"^```.*?^```", flags=re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(.*)$", flags=re.M)


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors of a page's headings; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCED.sub("", page.read_text())):
        anchor = heading_anchor(heading)
        repeats = seen.get(anchor, 0)
        seen[anchor] = repeats + 1
        found.add(anchor if repeats == 0 else f"{anchor}-{repeats}")
    return frozenset(found)


def test_the_pages_link_to_one_another() -> None:
    """The check below has something to check: the docs are cross-linked."""
    assert len(PAGES) > 10
    assert any(LINK.search(page.read_text()) for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_reach_a_file_and_a_heading(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCED.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not this test's to check
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)
