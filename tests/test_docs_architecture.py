"""docs/ARCHITECTURE.md describes the tree as it is today.

It stays short, its module map names every module under recsys/ and embedding_server/ once
(as a path, one line each), every module path it names exists (so a rename or a deletion
breaks this test until the page follows), its links resolve, and it holds no dates, clock
times or commit ids (those belong to BENCHMARKS.md, docs/benchmarks-history.md,
docs/decisions/ and git). README and docs never send readers to ../shared/.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("recsys", "embedding_server")
MAX_LINES = 350

MODULE_PATH = re.compile(r"`((?:recsys|embedding_server)/[\w/]*\.py)`")
MAP_ENTRY = re.compile(r"- `((?:recsys|embedding_server)/[\w/]*\.py)`: \S")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DATE = re.compile(r"\b\d{4}-\d{2}(?:-\d{2})?\b")
CLOCK = re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\b")
HEXWORD = re.compile(r"\b[0-9a-f]{7,40}\b")


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _map_lines() -> list[str]:
    match = re.search(r"^## Module map\n(.*?)(?=^## )", _text(), re.S | re.M)
    assert match, "docs/ARCHITECTURE.md: no '## Module map' section followed by another '## ' section"
    return match.group(1).splitlines()


def _map_entries() -> list[str]:
    return [m.group(1) for line in _map_lines() if (m := MAP_ENTRY.match(line))]


def _modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_is_short():
    lines = len(_text().splitlines())
    assert lines <= MAX_LINES, f"docs/ARCHITECTURE.md has {lines} lines, at most {MAX_LINES} expected"


def test_map_entries_have_one_form():
    """Every list line of the map is '- `path.py`: what it owns', so none escapes the checks below."""
    odd = [line for line in _map_lines() if line.startswith("- ") and not MAP_ENTRY.match(line)]
    assert not odd, f"docs/ARCHITECTURE.md, Module map: lines not of the form '- `recsys/....py`: ...': {odd}"


def test_map_names_every_module_once():
    entries = _map_entries()
    missing = sorted(_modules() - set(entries))
    assert not missing, f"docs/ARCHITECTURE.md, Module map: no line for {missing}"
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    assert not repeated, f"docs/ARCHITECTURE.md, Module map: more than one line for {repeated}"


def test_every_module_it_names_exists():
    named = set(MODULE_PATH.findall(_text()))
    assert named, "docs/ARCHITECTURE.md names no module path at all"
    gone = sorted(named - _modules())
    assert not gone, f"docs/ARCHITECTURE.md names modules that do not exist: {gone}"


def test_links_resolve():
    broken = []
    for target in LINK.findall(_text()):
        if "://" in target or target.startswith("#"):
            continue
        if not (DOC.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"docs/ARCHITECTURE.md links to missing files: {broken}"


def test_no_dates_clock_times_or_commit_ids():
    found = []
    for number, line in enumerate(_text().splitlines(), 1):
        hits = DATE.findall(line) + CLOCK.findall(line)
        hits += [w for w in HEXWORD.findall(line) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
        found += [f"line {number}: {hit}" for hit in hits]
    assert not found, f"docs/ARCHITECTURE.md holds dates, clock times or commit ids: {found}"


def test_docs_never_send_readers_to_shared():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = [p.relative_to(ROOT).as_posix() for p in pages if "../shared" in p.read_text(encoding="utf-8")]
    assert not bad, f"these pages send readers to ../shared/: {bad}"
