"""``recsys convert`` killed (SIGKILL) at every point of its output: the directory holds the
whole data set or the reader refuses it, never a short one; the next conversion into it
finishes an interrupted move or clears what a crash left, and what was there stays.

The kills come from the test hook of ``recsys.io.convert_output`` (``RECSYS_FAULT_CONVERT``): the
process SIGKILLs itself at the named point, as the checkpoint crash test does.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.io import convert_output as converter
from recsys.io.errors import ReadError
from recsys.io.convert import ConvertError, ConvertOptions, convert
from recsys.io.units import CONVERT_PENDING, expand_paths

ROWS, PER_FILE, PER_GROUP = 1000, 200, 100  # five output files
OPTS = dict(fmt="csv", rows_per_file=PER_FILE, row_group_rows=PER_GROUP)
# what the reader finds in the directory right after the kill (module doc of recsys.io.convert_output)
POINTS = {
    "mid-write": "nothing",  # one file written, into the hidden directory
    "written": "nothing",  # all written and fsynced, no marker yet
    "marked": "refused",  # the marker, no file moved in yet
    "mid-move": "refused",  # one file moved in
    "moved": "refused",  # all moved in, the marker still there
    "unmarked": "whole",  # the marker removed, the hidden directory not yet
}
assert tuple(POINTS) == converter.FAULT_POINTS


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, pa.Table]:
    """A CSV file and the table an uninterrupted conversion of it reads back."""
    root = tmp_path_factory.mktemp("convert-crash")
    path = root / "in.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "price", "item"])
        for i in range(ROWS):
            w.writerow([i % 2, i / 8, f"item-{i % 37}"])
    convert([str(path)], root / "whole", ConvertOptions(**OPTS))
    return path, _read(root / "whole")


def _read(out: Path, paths: list[str] | None = None) -> pa.Table:
    """Every row the reader takes from ``out`` (ReadError when it refuses it)."""
    files = expand_paths(paths or [str(out)])
    return pa.concat_tables(pq.read_table(f.path) for f in files)


def _killed_run(source: Path, out: Path, point: str) -> None:
    env = {**os.environ, converter.FAULT_ENV: point}
    cmd = [sys.executable, "-m", "recsys.cli", "convert", "--from", "csv", str(source), "--out", str(out),
           "--rows-per-file", str(PER_FILE), "--row-group-rows", str(PER_GROUP), "--no-progress"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, (
        f"expected the conversion killed at {point!r}, found exit code {done.returncode}: {done.stderr[-2000:]}")


@pytest.mark.parametrize("point", list(POINTS))
def test_a_conversion_killed_at_any_point_is_whole_or_refused_and_the_next_one_recovers(source, tmp_path, point):
    path, whole = source
    out = tmp_path / "out"
    out.mkdir()
    (out / "_notes.txt").write_text("mine")  # what the directory held before: never touched
    _killed_run(path, out, point)

    seen = POINTS[point]
    parts = sorted(out.glob("part-*.parquet"))
    if seen == "nothing":
        assert parts == []
        with pytest.raises(ReadError, match="no files in it"):
            _read(out)
        assert len(list(out.glob(".convert-*"))) == 1, "the kill left no hidden directory: it missed its point"
    elif seen == "refused":
        assert (out / CONVERT_PENDING).is_file()
        with pytest.raises(ReadError, match=f"{out}: expected a directory `recsys convert` finished writing, "
                                            f"found {CONVERT_PENDING} in it"):
            _read(out)
        if parts:  # naming the files, or a glob of them, is refused alike
            with pytest.raises(ReadError, match=CONVERT_PENDING):
                _read(out, [str(parts[0])])
            with pytest.raises(ReadError, match=CONVERT_PENDING):
                _read(out, [str(out / "part-*.parquet")])
    else:
        assert _read(out).equals(whole)

    # the same command again: converts (nothing was moved in), or finishes the move and says
    # the directory already holds a conversion
    logged = []
    if seen == "nothing":
        report = convert([str(path)], out, ConvertOptions(**OPTS), log=logged.append)
        assert report["rows"] == ROWS
    else:
        why = "an interrupted conversion's, whose move this run finished" if seen == "refused" else ""
        with pytest.raises(ConvertError, match=f"without part-\\*.parquet files .*found 5{'.*' + why if why else ''}"):
            convert([str(path)], out, ConvertOptions(**OPTS), log=logged.append)
        assert any("finished moving in the 6 files" in m for m in logged) == (seen == "refused"), logged
    assert _read(out).equals(whole)
    assert sorted(p.name for p in out.iterdir()) == [
        "_convert.json", "_notes.txt", *(f"part-{i:05d}.parquet" for i in range(5))]
    assert (out / "_notes.txt").read_text() == "mine"
    assert f'"rows": {ROWS}' in (out / "_convert.json").read_text()


def test_a_failed_conversion_leaves_the_directory_as_it_was(source, tmp_path):
    path, _ = source
    bad = tmp_path / "z.csv"  # read after ``path``'s files were written: another header
    bad.write_text("label,cost,item\n1,2.5,a\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "_job.toml").write_text("# edited by hand\n")
    with pytest.raises(ConvertError, match="z.csv: line 1: expected the header of the first file"):
        convert([str(path), str(bad)], out, ConvertOptions(**OPTS))
    assert sorted(p.name for p in out.iterdir()) == ["_job.toml"]
    assert (out / "_job.toml").read_text() == "# edited by hand\n"


def test_every_file_is_on_disk_before_the_marker_and_the_directory_after_the_moves(source, tmp_path, monkeypatch):
    path, _ = source
    out = tmp_path / "out"
    events = []
    real_file, real_dir, real_replace = converter.fsync_file, converter.fsync_dir, os.replace
    monkeypatch.setattr(converter, "fsync_file", lambda p: events.append(("fsync", Path(p).name)) or real_file(p))
    monkeypatch.setattr(converter, "fsync_dir", lambda p: events.append(("fsync dir", Path(p))) or real_dir(p))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("move", Path(b))) or real_replace(a, b))
    convert([str(path)], out, ConvertOptions(**OPTS))
    moves = [i for i, (what, p) in enumerate(events) if what == "move" and p.parent == out]
    names = [events[i][1].name for i in moves]
    assert names == [*(f"part-{i:05d}.parquet" for i in range(5)), "_convert.json"]
    for name in names:
        assert ("fsync", name) in events[: moves[0]], f"{name} was moved in before it was fsynced"
    assert ("fsync dir", out) in events[moves[-1]:], f"{out} was not fsynced after the moves"
