"""Writing Parquet the reader reads well: zstd, fixed-size row groups, files of bounded size.

Shared by the synthetic data generator and ``recsys convert``. No torch here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq


class SplitWriter:
    """Cuts a stream of tables into files of ``rows_per_file`` rows and row groups of ``row_group_size``.

    Files are ``directory/part-NNNNN.parquet``, each written under a ``.tmp`` name and renamed
    when complete, so a crash never leaves a short file that looks whole.
    """

    def __init__(self, directory: Path, rows_per_file: int, row_group_size: int,
                 progress: Callable[[str], None] | None) -> None:
        self.directory = Path(directory)
        self.rows_per_file = rows_per_file
        self.row_group_size = row_group_size
        self.progress = progress
        self.files = 0
        self.paths: list[Path] = []
        """Complete files, in order."""
        self._writer: pq.ParquetWriter | None = None
        self._path: Path | None = None
        self._in_file = 0
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    def add(self, table: pa.Table) -> None:
        offset = 0
        while offset < table.num_rows:
            if self._writer is None:
                self._open(table.schema)
            take = min(table.num_rows - offset, self.rows_per_file - self._in_file)
            self._pending.append(table.slice(offset, take))
            self._pending_rows += take
            self._in_file += take
            offset += take
            if self._pending_rows >= self.row_group_size:
                self._write_groups(final=False)
            if self._in_file == self.rows_per_file:
                self._close()

    def finish(self) -> None:
        if self._writer is not None:
            self._close()

    def abort(self) -> None:
        """Drop the file being written (its ``.tmp``); complete files stay."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._tmp().unlink(missing_ok=True)
        self._pending, self._pending_rows = [], 0

    def _open(self, schema: pa.Schema) -> None:
        self._path = self.directory / f"part-{self.files:05d}.parquet"
        self._writer = pq.ParquetWriter(self._tmp(), schema, compression="zstd")
        self._in_file = 0

    def _tmp(self) -> Path:
        return self._path.with_name(self._path.name + ".tmp")

    def _write_groups(self, final: bool) -> None:
        """Write every full row group pending (and, if ``final``, the short remainder)."""
        merged = pa.concat_tables(self._pending).combine_chunks()  # one copy, then slices
        size, done = self.row_group_size, 0
        while merged.num_rows - done >= size or (final and done < merged.num_rows):
            rows = min(size, merged.num_rows - done)
            self._writer.write_table(merged.slice(done, rows), row_group_size=rows)
            done += rows
        rest = merged.slice(done)
        self._pending = [rest] if rest.num_rows else []
        self._pending_rows = rest.num_rows

    def _close(self) -> None:
        if self._pending_rows:
            self._write_groups(final=True)
        self._writer.close()
        os.replace(self._tmp(), self._path)
        self.files += 1
        self.paths.append(self._path)
        if self.progress is not None:
            self.progress(f"wrote {self._path} ({self._in_file:,} rows)")
        self._writer = None
