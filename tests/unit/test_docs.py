"""The user docs lead somewhere: every relative link of README.md, docs/ and benchmarks/README.md names a file of the
repository, and every anchor a heading of that file (as GitHub makes anchors from headings)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(path: Path) -> set:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces to
    ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    seen, out = {}, set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def links(path: Path) -> list:
    """``(target, anchor)`` of every relative link outside code blocks."""
    out = []
    for target in LINK.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        out.append((file, anchor))
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_and_anchor_resolves(page):
    broken = []
    for file, anchor in links(page):
        target = (page.parent / file).resolve() if file else page
        if not target.exists():
            broken.append(f"{file}: no such file")
        elif ROOT not in target.parents and target != ROOT:
            broken.append(f"{file}: outside the repository")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{file}#{anchor}: no such heading in {target.relative_to(ROOT)}")
    assert broken == []


def test_the_check_finds_a_broken_link_and_anchor(tmp_path):
    """Not vacuous: a missing file and a missing anchor are found, a heading with code and punctuation matches."""
    page = tmp_path / "a.md"
    page.write_text("# The `x` option: why?\n\n## Twice\n\n## Twice\n\n[ok](#the-x-option-why) [ok](#twice-1) "
                    "[bad](#nope) [gone](missing.md) [web](https://example.com)\n```\n[in code](nowhere.md)\n```\n")
    assert anchors(page) == {"the-x-option-why", "twice", "twice-1"}
    assert links(page) == [("", "the-x-option-why"), ("", "twice-1"), ("", "nope"), ("missing.md", "")]


DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
USER_PAGES = [p for p in PAGES if p.name != "CHANGELOG.md"]


def table_cells(text: str) -> list:
    """The cells of every Markdown table row outside code blocks."""
    return [cell.strip() for line in FENCE.sub("", text).splitlines() if line.startswith("|")
            for cell in line.strip().strip("|").split("|")]


@pytest.mark.parametrize("page", USER_PAGES, ids=[str(p.relative_to(ROOT)) for p in USER_PAGES])
def test_pages_say_what_is_true_now(page):
    """A user page carries no date (history belongs in CHANGELOG.md) and no table cell over 400 characters."""
    text = page.read_text(encoding="utf-8")
    assert [line for line in text.splitlines() if DATE.search(line)] == []
    assert [cell[:80] for cell in table_cells(text) if len(cell) > 400] == []


def test_the_guidance_pages_stay_short():
    """docs/performance.md is guidance (at most about 400 lines; full results live in docs/results/); the README's
    Measured section keeps the few figures a user decides on (at most 6 rows)."""
    assert len((ROOT / "docs" / "performance.md").read_text(encoding="utf-8").splitlines()) <= 420
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    measured = readme.split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in measured.splitlines() if line.startswith("|")]
    assert 0 < len(rows) - 2 <= 6, rows  # the header and its rule, then the rows


def test_the_shape_checks_find_a_date_and_a_long_cell():
    """Not vacuous: a dated line and a 401-character cell are found."""
    assert DATE.search("measured on 2026-12-07")
    assert [len(c) for c in table_cells("| a | " + "x" * 401 + " |\n")] == [1, 401]
