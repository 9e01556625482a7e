"""Hive-style partitions (``date=2026-11-01/hour=07/part-0.parquet``) and the job's filter on them.

``data.<split>.filter`` selects files by the ``key=value`` directories in their paths, so a
daily-retraining job picks its window without moving files::

    filter = "date >= '2026-11-01' and date < '2026-11-08'"
    filter = "region in ('eu', 'us') and not (hour = 3)"

Grammar: comparisons ``key OP literal`` (``=``, ``==``, ``!=``, ``<>``, ``<``, ``<=``, ``>``,
``>=``) and ``key in (literal, ...)``, combined with ``and``, ``or``, ``not`` and parentheses.
A quoted literal compares as text (ISO dates sort as text); a bare number compares as a
number, and the partition value must then be one. Values are URL-unquoted as Hive writes
them (``%20``). Partition keys select files only: they are not columns of the batches. No
torch here; parsing runs when the job is loaded, so a bad filter fails early.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from recsys.io.errors import ReadError

_TOKEN = re.compile(r"""\s*(?:(?P<str>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")|(?P<num>[+-]?\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)"""
                    r"""|(?P<op>==|!=|<>|<=|>=|=|<|>|\(|\)|,)|(?P<word>[A-Za-z_][A-Za-z0-9_.\-]*))""")
_OPS = {"=": "==", "==": "==", "!=": "!=", "<>": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}


@dataclass(frozen=True, slots=True)
class Filter:
    """A parsed partition filter: ``matches(values)`` on one file's partition values."""

    text: str
    tree: tuple

    @property
    def keys(self) -> set[str]:
        """The partition keys the filter names."""
        out: set[str] = set()

        def walk(node):
            if node[0] in ("and", "or"):
                walk(node[1]), walk(node[2])
            elif node[0] == "not":
                walk(node[1])
            else:
                out.add(node[1])

        walk(self.tree)
        return out

    def matches(self, values: dict[str, str], file: str = "") -> bool:
        """Return whether a file with partition ``values`` is selected (ReadError if it lacks a key)."""
        for key in sorted(self.keys - values.keys()):
            _value(values, key, "", file, self.text)  # raises, naming the file and its partitions
        return _eval(self.tree, values, file, self.text)


def parse_filter(text: str) -> Filter | None:
    """Return the parsed filter (None for an empty one); ValueError naming the position of a mistake."""
    if not text or not text.strip():
        return None
    tokens = _tokenize(text)
    pos, tree = _or(tokens, 0, text)
    if pos != len(tokens):
        raise ValueError(f"filter {text!r}: unexpected {tokens[pos][1]!r} at character {tokens[pos][2] + 1}")
    return Filter(text, tree)


def partition_values(path: str) -> dict[str, str]:
    """Return the ``key=value`` directories of ``path`` (URL-unquoted), the innermost winning."""
    out = {}
    for part in path.replace("\\", "/").split("/")[:-1]:
        key, eq, value = part.partition("=")
        if eq and key:
            out[urllib.parse.unquote(key)] = urllib.parse.unquote(value)
    return out


def select(files: list, flt: Filter | None, what: str) -> list:
    """Return the files (``SourceFile``) whose partitions match ``flt``; ReadError when none do."""
    if flt is None:
        return files
    kept = [f for f in files if flt.matches(partition_values(f.path), f.display)]
    if not kept:
        seen = sorted({"/".join(f"{k}={v}" for k, v in partition_values(f.path).items()) for f in files})
        shown = ", ".join(seen[:8]) + (" ..." if len(seen) > 8 else "")
        raise ReadError(file=what, expected=f"at least one file whose partitions match filter {flt.text!r}",
                        found=f"none of {len(files)} file(s) (partitions: {shown})")
    return kept


# --------------------------------------------------------------------------- parsing


def _tokenize(text: str) -> list[tuple[str, object, int]]:
    out, i = [], 0
    while i < len(text):
        if text[i:].strip() == "":
            break
        m = _TOKEN.match(text, i)
        if m is None or m.end() == i:
            j = len(text) - len(text[i:].lstrip())
            raise ValueError(f"filter {text!r}: cannot read {text[j:j + 10]!r} at character {j + 1}")
        start = m.start(m.lastgroup)
        kind, raw = m.lastgroup, m.group(m.lastgroup)
        if kind == "str":
            out.append(("lit", bytes(raw[1:-1], "utf-8").decode("unicode_escape"), start))
        elif kind == "num":
            out.append(("lit", float(raw), start))
        elif kind == "word" and raw.lower() in ("and", "or", "not", "in"):
            out.append(("kw", raw.lower(), start))
        else:
            out.append((kind, raw, start))
        i = m.end()
    return out


def _expect(tokens, pos, text, what: str):
    if pos >= len(tokens):
        raise ValueError(f"filter {text!r}: expected {what} at the end")
    return tokens[pos]


def _binary(op: str, operand):
    """Return the parser of ``operand (op operand)*``, left-associative: ``(op, left, right)``."""
    def parse(tokens, pos, text):
        pos, left = operand(tokens, pos, text)
        while pos < len(tokens) and tokens[pos][:2] == ("kw", op):
            pos, right = operand(tokens, pos + 1, text)
            left = (op, left, right)
        return pos, left
    return parse


def _or(tokens, pos, text):
    return _binary("or", _and)(tokens, pos, text)


def _and(tokens, pos, text):
    return _binary("and", _not)(tokens, pos, text)


def _not(tokens, pos, text):
    tok = _expect(tokens, pos, text, "a comparison")
    if tok[:2] == ("kw", "not"):
        pos, inner = _not(tokens, pos + 1, text)
        return pos, ("not", inner)
    if tok[:2] == ("op", "("):
        pos, inner = _or(tokens, pos + 1, text)
        close = _expect(tokens, pos, text, "')'")
        if close[:2] != ("op", ")"):
            raise ValueError(f"filter {text!r}: expected ')' at character {close[2] + 1}, found {close[1]!r}")
        return pos + 1, inner
    if tok[0] != "word":
        raise ValueError(f"filter {text!r}: expected a partition key at character {tok[2] + 1}, found {tok[1]!r}")
    key = tok[1]
    op = _expect(tokens, pos + 1, text, f"an operator after {key!r}")
    if op[:2] == ("kw", "in"):
        lp = _expect(tokens, pos + 2, text, "'('")
        if lp[:2] != ("op", "("):
            raise ValueError(f"filter {text!r}: expected '(' after 'in' at character {lp[2] + 1}")
        values, pos = [], pos + 3
        while True:
            lit = _expect(tokens, pos, text, "a literal")
            if lit[0] != "lit":
                raise ValueError(f"filter {text!r}: expected a quoted text or a number at character {lit[2] + 1}, "
                                 f"found {lit[1]!r}")
            values.append(lit[1])
            sep = _expect(tokens, pos + 1, text, "',' or ')'")
            pos += 2
            if sep[:2] == ("op", ")"):
                return pos, ("in", key, tuple(values))
            if sep[:2] != ("op", ","):
                raise ValueError(f"filter {text!r}: expected ',' or ')' at character {sep[2] + 1}, found {sep[1]!r}")
    if op[0] != "op" or op[1] not in _OPS:
        raise ValueError(f"filter {text!r}: expected a comparison operator after {key!r} at character {op[2] + 1}, "
                         f"found {op[1]!r}")
    lit = _expect(tokens, pos + 2, text, "a literal")
    if lit[0] != "lit":
        raise ValueError(f"filter {text!r}: expected a quoted text or a number at character {lit[2] + 1}, "
                         f"found {lit[1]!r} (quote text values: '...')")
    return pos + 3, ("cmp", key, _OPS[op[1]], lit[1])


# --------------------------------------------------------------------------- evaluation


def _value(values: dict[str, str], key: str, literal, file: str, text: str):
    if key not in values:
        have = ", ".join(f"{k}={v}" for k, v in values.items()) or "none"
        raise ReadError(file=file, expected=f"a partition directory '{key}=...' (filter {text!r})",
                        found=f"partitions {have}")
    raw = values[key]
    if isinstance(literal, float):
        try:
            return float(raw)
        except ValueError:
            raise ReadError(file=file, expected=f"a number for partition {key!r} (filter {text!r} compares it "
                            f"with {literal:g}; quote the literal to compare text)", found=repr(raw)) from None
    return raw


def _eval(node, values, file, text) -> bool:
    kind = node[0]
    if kind == "and":
        return _eval(node[1], values, file, text) and _eval(node[2], values, file, text)
    if kind == "or":
        return _eval(node[1], values, file, text) or _eval(node[2], values, file, text)
    if kind == "not":
        return not _eval(node[1], values, file, text)
    if kind == "in":
        return any(_value(values, node[1], lit, file, text) == lit for lit in node[2])
    _, key, op, lit = node
    v = _value(values, key, lit, file, text)
    return {"==": v == lit, "!=": v != lit, "<": v < lit, "<=": v <= lit, ">": v > lit, ">=": v >= lit}[op]
