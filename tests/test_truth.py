"""Code says what is true now; the record of when and at which commit lives elsewhere.

A product module's comments and docstrings say what the module owns and why. The date, clock
time or commit of the measurement that decided something goes to BENCHMARKS.md (today's
figures) or docs/benchmarks-history.md (earlier ones), and the commit to git: in a docstring
it is stale the day the code moves on. The same holds for the comments of the Makefile and
pyproject.toml. The user-facing documents name only files that exist.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PRODUCT_DIRS = ("recsys", "embedding_server", "scripts")
NOT_PRODUCT = ("recsys/bench/", "recsys/testing/")
"""Benchmarks and test helpers record how they were run; every other module is product code."""

_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
          r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
PATTERNS = {
    # 2026-11-29 or 2026-11; not a value in an example (``date=2026-11-01/``, ``date >=
    # '2026-11-01'``): that is data, not the day something was measured
    "date": re.compile(r"(?<![='\"\w-])(?:19|20)\d\d-(?:0[1-9]|1[0-2])(?:-(?:0[1-9]|[12]\d|3[01]))?(?![\w-])"),
    # Nov 29, November 29th, 29 Nov, November 2026 (month names capitalized, as in a date)
    "month-name date": re.compile(rf"\b{_MONTH}\.? (?:\d{{1,2}}(?:st|nd|rd|th)?\b(?!:)|(?:19|20)\d\d\b)"
                                  rf"|\b\d{{1,2}} {_MONTH}\b"),
    # 21:05, 21:05:33, 9:41 UTC; not a slice (``a[1:30]``), a port (``host:8000``) or a ratio
    "clock time": re.compile(r"(?<![\w:.\[])(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d)?(?:\s*UTC)?(?![\w:\]])"),
    # a commit: 7-40 hex digits with a letter and a digit, in backticks (`3e817e1`), in
    # parentheses, or after a word that dates code (at, since, until, commit...); a hex
    # constant (0x9E3779B97F4A7C15) or a key in a layout is none of these
    "commit": re.compile(
        r"(?:`{1,2}|\(|\b(?:commits?|at|since|until|before|after|from|base|checkout|worktree|"
        r"revision|rev|sha)\s+)"
        r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])([0-9a-f]{7,40})(?![\w])"),
}


def product_modules() -> list[Path]:
    """Every product ``.py`` file (``PRODUCT_DIRS`` less ``NOT_PRODUCT``)."""
    out = []
    for d in PRODUCT_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(NOT_PRODUCT):
                out.append(path)
    return out


def python_prose(source: str) -> list[tuple[int, str]]:
    """Return (line, text) of every comment and every docstring line of ``source``.

    Comments come from ``tokenize``; docstrings are the string expression statements ``ast``
    finds anywhere (a module's, a class's, a function's, and the one after an attribute or
    field), read from the source itself so each line keeps its own number."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            for number in range(node.lineno, node.end_lineno + 1):
                out.append((number, lines[number - 1]))
    return sorted(set(out))


def config_comments(path: Path) -> list[tuple[int, str]]:
    """Return (line, text) of the comments of a Makefile or a TOML file: what follows a ``#``."""
    return [(n, line[line.index("#"):]) for n, line in enumerate(path.read_text().splitlines(), 1) if "#" in line]


def violations(prose: list[tuple[int, str]], where: str) -> list[str]:
    """Return ``where:line: kind `text` in: line`` for every date, clock time and commit in ``prose``."""
    found = []
    for number, text in prose:
        for kind, pattern in PATTERNS.items():
            for match in pattern.finditer(text):
                hit = match.group(match.lastindex or 0)
                found.append(f"{where}:{number}: {kind} {hit!r} in: {text.strip()[:120]}")
    return found


def test_no_date_clock_time_or_commit_in_product_comments_and_docstrings():
    found = []
    for path in product_modules():
        found += violations(python_prose(path.read_text()), path.relative_to(ROOT).as_posix())
    for name in ("Makefile", "pyproject.toml"):
        found += violations(config_comments(ROOT / name), name)
    if found:
        pytest.fail(f"{len(found)} date(s), clock time(s) or commit id(s) in product comments or docstrings; "
                    "say what the code does and why, and move the measurement to BENCHMARKS.md or "
                    "docs/benchmarks-history.md:\n" + "\n".join(found), pytrace=False)


@pytest.mark.parametrize("text, kind", [
    ("# measured 2026-11-29 on 2 cores", "date"),
    ("# (as before 2026-11: two passes)", "date"),
    ("# (November 29, 2 cores)", "month-name date"),
    ("# as of 29 Nov", "month-name date"),
    ("# the 21:05 UTC run", "clock time"),
    ("# at 21:05", "clock time"),
    ("# since commit 3e817e1", "commit"),
    ("# (`fdb53ef`: the old index)", "commit"),
    ("# the runs at f9eb9b0 and 0ace046", "commit"),
])
def test_each_pattern_finds_what_it_is_for(text, kind):
    assert [v for v in violations([(1, text)], "x.py") if f": {kind} " in v], (kind, text)


@pytest.mark.parametrize("text", [
    "# golden constant 0x9E3779B97F4A7C15",
    "# ``date=2026-11-01/hour=07/part-0.parquet``",
    "#     filter = \"date >= '2026-11-01' and date < '2026-11-08'\"",
    "# ``x[:, 1:30]``, ``127.0.0.1:8000``, ``host:6379``",
    "# ns:{v:table:bbbb}:kkkkkkkkkkkkkkkk (16 hex digits)",
    "# float16, int64, fmix64, 2048 rows, May be slower",
    "# (Gorishniy et al., 2022), the 2013 flights, 16-32 rows, 1-30 ms",
    "# deadbeef and 1234567 (hex of one kind only)",
])
def test_what_the_patterns_leave_alone(text):
    assert violations([(1, text)], "x.py") == []


def test_a_dated_comment_in_a_module_is_found_with_its_line(tmp_path):
    source = '"""A module."""\n\nX = 1  # 1.3x faster (2026-11-29, AMD EPYC)\n\n\ndef f():\n    """At `3e817e1`."""\n'
    found = violations(python_prose(source), "m.py")
    assert [v.split(" in:")[0] for v in found] == ["m.py:3: date '2026-11-29'", "m.py:7: commit '3e817e1'"]


# --------------------------------------------------------------------------- the documents

USER_DOCS = ["README.md", "BENCHMARKS.md", "RELIABILITY.md"] + sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")
    if p.name not in ("ARCHITECTURE.md", "benchmarks-history.md"))
"""The documents a user reads for what is true now (the history records what was true then)."""

_CODE_PATH = re.compile(r"(?<![\w/.-])((?:recsys|embedding_server|scripts|tests)/[\w/.-]*\.py)\b")


@pytest.mark.parametrize("doc", USER_DOCS)
def test_documents_name_only_files_that_exist(doc):
    text = (ROOT / doc).read_text()
    missing = [f"{doc}:{n}: {m.group(1)}" for n, line in enumerate(text.splitlines(), 1)
               for m in _CODE_PATH.finditer(line) if not (ROOT / m.group(1)).is_file()]
    assert not missing, "documents name files that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", USER_DOCS)
def test_documents_never_send_readers_to_shared(doc):
    text = (ROOT / doc).read_text()
    bad = [f"{doc}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if "../shared" in line]
    assert not bad, "\n".join(bad)


def test_the_user_scripts_are_documented():
    """scripts/ holds only what a user runs, and the docs say what each one does."""
    docs = "\n".join((ROOT / d).read_text() for d in USER_DOCS)
    undocumented = [p.name for p in sorted((ROOT / "scripts").glob("*.py")) if f"scripts/{p.name}" not in docs]
    assert not undocumented, f"scripts no document names: {undocumented}"
