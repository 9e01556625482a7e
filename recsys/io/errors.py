"""The reader's one error type: bad input, named by file, row group, column and row.

Which input is an error, which is skipped (``on_bad_file = "skip"``) and which is read
past, with the counter each lands in: the table in docs/data.md.
"""

from __future__ import annotations

from recsys.errors import UserError


class ReadError(UserError):
    """Bad input data: says where (file, row group, column, row) and what was expected vs found.

    The fields are kept as attributes so callers (and tests) can act on them; the message
    reads ``<file>: row group <rg>: column '<col>': expected <expected>, found <found>``.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        file: str | None = None,
        row_group: int | None = None,
        column: str | None = None,
        row: int | None = None,
        expected: str | None = None,
        found: str | None = None,
    ) -> None:
        self.file = file
        self.row_group = row_group
        self.column = column
        self.row = row
        self.expected = expected
        self.found = found
        if message is None:
            message = self._compose()
        super().__init__(message)

    def _compose(self) -> str:
        where = []
        if self.file is not None:
            where.append(str(self.file))
        if self.row_group is not None:
            where.append(f"row group {self.row_group}")
        if self.column is not None:
            where.append(f"column {self.column!r}")
        if self.row is not None:
            where.append(f"row {self.row}")
        what = []
        if self.expected is not None:
            what.append(f"expected {self.expected}")
        if self.found is not None:
            what.append(f"found {_one_line(self.found)}")
        return ": ".join(where + [", ".join(what) or "bad input"])

    def fields(self) -> dict:
        """Return the error's message and fields as plain data (to cross process boundaries)."""
        return {
            "message": str(self),
            "file": self.file,
            "row_group": self.row_group,
            "column": self.column,
            "row": self.row,
            "expected": self.expected,
            "found": self.found,
        }

    @classmethod
    def from_fields(cls, data: dict) -> "ReadError":
        """Return the error that ``fields()`` described (same message, same attributes)."""
        return cls(
            data["message"],
            file=data["file"],
            row_group=data["row_group"],
            column=data["column"],
            row=data["row"],
            expected=data["expected"],
            found=data["found"],
        )

    def __reduce__(self):
        return (_rebuild, (self.fields(),))


def _one_line(text: str) -> str:
    """Return ``text`` on one line (Arrow's messages may span several)."""
    return " ".join(str(text).split())


def _rebuild(data: dict) -> ReadError:
    return ReadError.from_fields(data)
