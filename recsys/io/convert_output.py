"""The output of ``recsys convert`` (``recsys.io.convert``), whole or not at all: the output
directory's commit protocol.

The files are written into a hidden directory inside ``out`` (the reader skips hidden
names), held by a lock, and fsynced. Then ``out/_convert.pending`` names them (created
exclusively, fsynced), they are renamed into ``out`` one by one, and the marker goes: the
reader refuses a directory holding it. A crash before the marker leaves ``out`` as it was
(the next conversion into it removes the hidden directory); after it, the next conversion
into ``out`` finishes the move (every file was on disk before the marker was), so no crash
loses a finished conversion or shows a part of one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Callable

from recsys.runtime.durable import fsync_dir, fsync_file
from recsys.io.convert_options import ConvertError
from recsys.io.units import CONVERT_PENDING

FAULT_ENV = "RECSYS_FAULT_CONVERT"
"""Test hook (no effect when unset): the process SIGKILLs itself at this point of a conversion."""
FAULT_POINTS = ("mid-write", "written", "marked", "mid-move", "moved", "unmarked")
"""In order: the first output file written (into the hidden directory), all of them written
and fsynced, the marker written, the first file moved in, all moved in, the marker removed."""
_LOCK = ".lock"


def fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def refuse_parts(out: Path, finished: bool = False) -> None:
    parts = list(out.glob("part-*.parquet")) if out.is_dir() else []
    if parts:
        whose = (" (an interrupted conversion's, whose move this run finished: the directory holds its whole "
                 "output)") if finished else ""
        raise ConvertError(f"{out}: expected an output directory without part-*.parquet files (they would mix "
                           f"with this conversion's), found {len(parts)}{whose}; choose another --out or remove them")


def hold(tmp: Path) -> int:
    """Lock ``tmp`` for this conversion; return the descriptor holding the lock (released at close or death)."""
    import fcntl

    fd = os.open(tmp / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _abandoned(tmp: Path) -> bool:
    """Whether no live conversion holds ``tmp`` (its lock is free; no lock yet: its process is gone)."""
    import fcntl

    try:
        fd = os.open(tmp / _LOCK, os.O_RDWR)
    except FileNotFoundError:  # between the directory's creation and its lock: the pid in its name says
        pid = tmp.name.split("-")[1] if tmp.name.count("-") >= 2 else ""
        if not pid.isdigit():
            return True
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def remove_abandoned(out: Path) -> None:
    """Remove the hidden directories of conversions into ``out`` that died before their marker."""
    for tmp in out.glob(".convert-*"):
        if tmp.is_dir() and _abandoned(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def move_in(tmp: Path, out: Path, names: list[str]) -> None:
    """Move ``tmp``'s files ``names`` (output files first, the report last) into ``out`` (see the module doc)."""
    for name in names:
        fsync_file(tmp / name)
    fsync_dir(tmp)
    fault("written")
    marker = out / CONVERT_PENDING
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConvertError(f"{out}: expected no other conversion moving files in, found {marker} (one is "
                           "finishing now, or was interrupted: convert again once it is done)") from None
    try:
        os.write(fd, json.dumps({"from": tmp.name, "files": names}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(out)
    try:
        refuse_parts(out)  # another conversion finished into ``out`` while this one ran
    except ConvertError:
        marker.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fault("marked")
    for i, name in enumerate(names):
        os.replace(tmp / name, out / name)
        if i == 0:
            fault("mid-move")
    fsync_dir(out)
    fault("moved")
    marker.unlink()
    fsync_dir(out)
    fault("unmarked")
    shutil.rmtree(tmp, ignore_errors=True)


def finish_interrupted(out: Path, say: Callable[[str], None]) -> bool:
    """Finish the move of a conversion into ``out`` that died after its marker (its files are
    all on disk, in its hidden directory or moved in already); return whether there was one.
    ConvertError if that conversion is alive."""
    marker = out / CONVERT_PENDING
    if not marker.is_file():
        return False
    try:
        intent = json.loads(marker.read_text())
        src, names = out / intent["from"], list(intent["files"])
    except (ValueError, KeyError, TypeError):  # died while writing the marker: nothing moved yet
        marker.unlink()
        fsync_dir(out)
        return False
    if src.is_dir() and not _abandoned(src):
        raise ConvertError(f"{out}: expected no other conversion moving files in, found {marker} (one is "
                           "finishing now: convert again once it is done)")
    lost = [n for n in names if not (src / n).exists() and not (out / n).exists()]
    if lost:
        raise ConvertError(f"{marker}: expected the files of an interrupted conversion in {src} or {out}, found "
                           f"{lost} in neither; the directory holds part of a data set: remove it and convert again")
    for name in names:
        if (src / name).exists():
            os.replace(src / name, out / name)
    fsync_dir(out)
    marker.unlink()
    fsync_dir(out)
    shutil.rmtree(src, ignore_errors=True)
    say(f"{out}: finished moving in the {len(names)} files of a conversion that was interrupted")
    return True
