"""The user's docs stay small and their links lead somewhere: a relative link names a file that exists, and its
``#anchor`` a heading in it (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_BYTES = 8 * 1024
DOCS_BYTES = 150 * 1024


def documents() -> list[Path]:
    """The README, docs/, and the benchmarks' READMEs (where measurement history lives)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
            *sorted((ROOT / "bench" / "results").glob("**/*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    bad = []
    for url in LINK.findall(text):
        if re.match(r"[a-z]+:", url):
            continue
        target, _, anchor = url.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            bad.append(f"{path.relative_to(ROOT)}: {url} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{path.relative_to(ROOT)}: {url} (no heading #{anchor} in {file.name})")
    return bad


def test_the_slugs_follow_github() -> None:
    assert slug("The realistic pair: Qwen2.5-Coder-1.5B served, its 0.5B sibling drafting") == (
        "the-realistic-pair-qwen25-coder-15b-served-its-05b-sibling-drafting")
    assert slug("`--json` output") == "--json-output"


def test_every_relative_link_in_the_docs_resolves() -> None:
    bad = [b for path in documents() for b in broken_links(path)]
    assert not bad, "\n".join(bad)


def test_the_readme_and_docs_stay_small() -> None:
    readme = (ROOT / "README.md").stat().st_size
    docs = sum(p.stat().st_size for p in (ROOT / "docs").glob("*.md"))
    assert readme <= README_BYTES, f"README.md is {readme} bytes; expected at most {README_BYTES}"
    assert docs <= DOCS_BYTES, f"docs/ holds {docs} bytes of markdown; expected at most {DOCS_BYTES}"
