"""Every command resolves a checkpoint the same way, from any of the paths a user holds."""

import json

import pytest

from recsys import checkpoint_files as cf


def _fake_run(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for step in (100, 200):
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"format_version": cf.FORMAT_VERSION, "step": step}))
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

    from recsys.train import checkpoint as ckpt

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
