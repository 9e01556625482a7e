"""Every command resolves a checkpoint the same way, from any of the paths a user holds."""

import json
import shutil

import pytest

from recsys.checkpoint import read as cf


def _fake_run(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for step in (100, 200):
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"format_version": cf.FORMAT_VERSION, "step": step}))
        (d / cf.MARKER).write_text(json.dumps({"files": {"meta.json": (d / "meta.json").stat().st_size}}))
    (root / "latest").write_text("step-00000200\n")
    return tmp_path / "run"


def test_resolve_accepts_every_form(tmp_path):
    run = _fake_run(tmp_path)
    newest = run / "checkpoints" / "step-00000200"
    assert cf.resolve(run) == newest
    assert cf.resolve(run / "checkpoints") == newest
    assert cf.resolve(run / "checkpoints" / "latest") == newest
    older = run / "checkpoints" / "step-00000100"
    assert cf.resolve(older) == older
    assert cf.load_meta(cf.resolve(run / "checkpoints" / "latest"))["step"] == 200


def test_resolve_errors_name_the_path_and_the_forms(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        cf.resolve(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="expected a step directory"):
        cf.resolve(tmp_path / "empty")
    run = _fake_run(tmp_path)
    (run / "checkpoints" / "latest").write_text("step-00000300\n")
    assert cf.resolve(run).name == "step-00000200"  # the newest complete one instead
    for d in (run / "checkpoints").glob("step-*"):
        (d / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        cf.resolve(run)


def _save(root, step, rows=3):
    import pyarrow as pa

    from recsys.checkpoint import write as ckpt

    table = pa.table({"key": pa.array(range(rows), pa.int64())})
    return ckpt.save(root, step, sparse={"t": table}, dense={}, meta={"config": ""}, keep_last=5)


def test_saved_checkpoints_carry_a_marker_that_loading_checks(tmp_path):
    root = tmp_path / "checkpoints"
    first, second = _save(root, 1), _save(root, 2)
    assert cf.incomplete(second) is None and (second / cf.MARKER).exists()
    assert cf.latest(root) == second
    shard = second / "sparse" / "t" / "rank-00000-of-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated, as a torn copy would be
    assert "truncated" in cf.incomplete(second)
    assert cf.latest(root) == first  # the pointer names a broken one: the newest complete instead
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        cf.resolve(second)
    shard.unlink()
    assert "missing" in cf.incomplete(second)
    with pytest.raises(FileNotFoundError, match="no shards of table 't'"):
        cf.load_sparse(second)


def test_a_directory_without_the_marker_is_never_a_checkpoint_even_with_every_shard(tmp_path):
    """A save cut short before its marker (``.tmp-step-*``) has meta.json and every rank's
    shard name while a shard is still short: it is refused, by name and as a fallback."""
    root = tmp_path / "checkpoints"
    done = _save(root, 1)
    cut = root / ".tmp-step-00000002"
    shutil.copytree(done, cut)
    (cut / cf.MARKER).unlink()
    meta = json.loads((cut / "meta.json").read_text())
    (cut / "meta.json").write_text(json.dumps({**meta, "step": 2}))
    shard = cut / "sparse" / "t" / "rank-00000-of-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:-10])  # still being written
    assert f"no {cf.MARKER}" in cf.incomplete(cut)
    with pytest.raises(FileNotFoundError, match=f"not a complete checkpoint: .*no {cf.MARKER}"):
        cf.resolve(cut)
    cut.rename(root / "step-00000002")  # under a checkpoint's name, with no pointer: not picked either
    (root / "latest").unlink()
    assert cf.latest(root) == done and cf.resolve(root) == done


def test_load_sparse_names_a_missing_rank_shard(tmp_path):
    folder = tmp_path / "ck" / "sparse" / "t"
    folder.mkdir(parents=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"key": [1]}), folder / "rank-00000-of-00002.parquet")
    with pytest.raises(FileNotFoundError, match="rank-00001-of-00002"):
        cf.load_sparse(tmp_path / "ck", ["t"])


def test_a_pointerless_root_takes_the_newest_complete(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, 1)
    newest = _save(root, 2)
    (root / "latest").unlink()  # a crash between the rename and the pointer
    assert cf.latest(root) == newest


def _save_marked(root, step, value, keep_last=5):
    """Save a checkpoint whose one row carries ``value`` (to tell two saves of a step apart)."""
    import pyarrow as pa

    from recsys.checkpoint import write as ckpt

    table = pa.table({"key": pa.array([7], pa.int64()), "value": pa.array([value], pa.float64())})
    return ckpt.save(root, step, sparse={"t": table}, dense={}, meta={"config": ""}, keep_last=keep_last)


def _value(path) -> float:
    return cf.load_sparse(path)["t"].column("value")[0].as_py()


def test_a_renamed_checkpoint_no_pointer_names_is_replaced_by_the_next_save_of_its_step(tmp_path):
    """A crash between the rename and the ``latest`` update leaves a complete step the pointer
    does not name; the resumed run (maybe at another world size) saves that step again: its
    state is the one kept, and ``latest`` names it."""
    root = tmp_path / "checkpoints"
    _save_marked(root, 1, 1.0)
    _save_marked(root, 2, 2.0)
    (root / "latest").write_text("step-00000001\n")  # the pointer update never happened
    assert cf.latest(root).name == "step-00000001"
    _save_marked(root, 2, 20.0)
    assert cf.latest(root).name == "step-00000002" and _value(cf.latest(root)) == 20.0
    assert not list(root.glob(".*-step-*"))
    # a re-save of the step ``latest`` names keeps the saved one (the same training state)
    _save_marked(root, 2, 200.0)
    assert _value(cf.latest(root)) == 20.0


def test_keep_last_keeps_the_newest_complete_checkpoints_and_best(tmp_path):
    from recsys.checkpoint import write as ckpt

    root = tmp_path / "checkpoints"
    for step in range(1, 4):
        _save_marked(root, step, float(step), keep_last=3)
    ckpt.set_pointer(root, "best", "step-00000002")
    damaged = root / "step-00000000"  # a broken copy is no checkpoint: it does not count
    damaged.mkdir()
    (damaged / "meta.json").write_text("{}")
    (damaged / cf.MARKER).write_text('{"files": {"dense.pt": 5}}')
    for step in range(4, 7):
        _save_marked(root, step, float(step), keep_last=3)
        names = sorted(p.name for p in root.glob("step-*") if cf.incomplete(p) is None)
        newest = [f"step-{s:08d}" for s in range(max(1, step - 2), step + 1)]
        assert names == sorted({"step-00000002", *newest})
    assert cf.resolve(root / "best").name == "step-00000002" and _value(root / "step-00000002") == 2.0


def test_leftovers_of_a_crash_are_never_picked_and_the_next_save_removes_them(tmp_path):
    root = tmp_path / "checkpoints"
    _save_marked(root, 1, 1.0)
    # a save killed before its rename, and a delete killed half way (renamed aside first)
    newer = _save_marked(tmp_path / "elsewhere", 5, 5.0)
    (newer / "sparse" / "t" / "rank-00000-of-00001.parquet").rename(newer / "partial.parquet")
    newer.rename(root / ".tmp-step-00000005")
    old = _save_marked(tmp_path / "elsewhere", 3, 3.0)
    (old / cf.MARKER).unlink()
    old.rename(root / ".del-step-00000003")
    (root / "latest").unlink()  # no pointer at all: the newest complete step-* is taken
    assert cf.latest(root).name == "step-00000001"
    _save_marked(root, 2, 2.0)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"]


def test_the_fault_hook_rejects_a_spec_it_does_not_know(tmp_path, monkeypatch):
    from recsys.checkpoint import write as ckpt

    monkeypatch.setenv(ckpt.FAULT_ENV, "after-lunch")
    with pytest.raises(ValueError, match="RECSYS_FAULT_CHECKPOINT='after-lunch': unknown point 'after-lunch'"):
        _save_marked(tmp_path / "checkpoints", 1, 1.0)
    monkeypatch.setenv(ckpt.FAULT_ENV, "prune:steps=3")
    with pytest.raises(ValueError, match=r"expected <point>\[:step=N\]\[:rank=R\], found 'steps=3'"):
        _save_marked(tmp_path / "checkpoints", 1, 1.0)
    monkeypatch.setenv(ckpt.FAULT_ENV, "prune:step=99")  # another step's save: no effect
    assert _value(_save_marked(tmp_path / "checkpoints", 1, 1.0)) == 1.0


def test_a_run_whose_first_pointer_was_never_written_resolves_to_its_checkpoint(tmp_path):
    """A crash between the first checkpoint's rename and its ``latest`` write: every
    --checkpoint / --resume form still finds the complete checkpoint."""
    root = tmp_path / "run" / "checkpoints"
    _save(root, 4)
    (root / "latest").unlink()
    for form in (tmp_path / "run", root):
        assert cf.resolve(form) == root / "step-00000004"


def test_load_sparse_reads_a_table_when_it_is_asked_for(tmp_path, monkeypatch):
    """A restore walks the tables one at a time: nothing is read up front, and each access
    reads only that table's shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsys.checkpoint import write as ckpt

    from pathlib import Path

    tables = {t: pa.table({"key": pa.array([i, i + 10], pa.int64())}) for i, t in enumerate(["a", "b", "c"])}
    path = ckpt.save(tmp_path / "ck", 1, sparse=tables, dense={}, meta={"config": ""}, keep_last=2)
    read = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda f, *a, **k: read.append(Path(f).parent.name) or real(f, *a, **k))
    saved = cf.load_sparse(path)
    assert read == [] and sorted(saved) == ["a", "b", "c"] and len(saved) == 3
    assert saved["b"].equals(tables["b"]) and read == ["b"]
    assert {n: t.num_rows for n, t in saved.items()} == {"a": 2, "b": 2, "c": 2} and read == ["b", "a", "b", "c"]


def test_every_file_and_directory_is_on_disk_before_the_rename_and_the_pointer_after(tmp_path, monkeypatch):
    """``save``'s fsync order: every file (the shards, dense.pt, meta.json, the marker) and
    every directory of ``.tmp-step-*`` is flushed before the rename to ``step-*``; the root
    after the rename and before ``latest`` moves; ``latest``'s temporary file before its
    rename and the root again after it (a crash at any point leaves a complete checkpoint
    or none, and ``latest`` naming one that is on disk)."""
    import os
    from pathlib import Path

    from recsys.checkpoint import write as ckpt
    from recsys.runtime import durable

    root = tmp_path / "checkpoints"
    _save(root, 1)  # a previous checkpoint: the second save also prunes and moves a pointer
    events = []
    real_file, real_dir, real_replace = durable.fsync_file, durable.fsync_dir, os.replace
    record_file = lambda p: events.append(("fsync", Path(p))) or real_file(p)  # noqa: E731
    record_dir = lambda p: events.append(("fsync dir", Path(p))) or real_dir(p)  # noqa: E731
    monkeypatch.setattr(durable, "fsync_file", record_file)  # fsync_tree's own calls
    monkeypatch.setattr(durable, "fsync_dir", record_dir)
    monkeypatch.setattr(ckpt, "fsync_file", record_file)
    monkeypatch.setattr(ckpt, "_fsync_dir", record_dir)
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("move", Path(a), Path(b))) or real_replace(a, b))
    final = _save(root, 2)
    tmp = root / ".tmp-step-00000002"
    moves = {e[2].name: i for i, e in enumerate(events) if e[0] == "move"}
    into_place, pointer = moves["step-00000002"], moves["latest"]
    assert events[into_place][1] == tmp and into_place < pointer
    files = sorted(p.relative_to(final) for p in final.rglob("*") if p.is_file())
    dirs = sorted(p.relative_to(final) for p in final.rglob("*") if p.is_dir())
    assert {str(f) for f in files} >= {"dense.pt", "meta.json", cf.MARKER, "sparse/t/rank-00000-of-00001.parquet"}
    before = events[:into_place]
    for f in files:
        assert ("fsync", tmp / f) in before, f"{f} was renamed into place before it was flushed"
    for d in [Path("."), *dirs]:
        assert ("fsync dir", tmp / d) in before, f"directory {d} was renamed into place before it was flushed"
    assert ("fsync dir", root) in events[into_place:pointer], "the rename was not flushed before latest moved"
    assert ("fsync", root / ".latest.tmp") in events[into_place:pointer]
    assert events[pointer][1] == root / ".latest.tmp"
    assert ("fsync dir", root) in events[pointer:], "latest's rename was not flushed"
    assert cf.latest(root) == final
