"""The docs hold together: every link in the README and docs/ leads to a file that exists (and,
with an anchor, to a heading there), and the README keeps its two first commands."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.M)}


def test_every_link_resolves():
    bad, seen = [], 0
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check offline
            seen += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert seen >= 10, "the scan found almost no links: it is broken"
    assert not bad, "\n".join(bad)


def test_the_readme_starts_with_its_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[3].startswith("bash scripts/dev.sh demo") and \
        lines[4].startswith("bash scripts/dev.sh test"), lines[:6]
