"""The row audit (train.record_rows): rolled-back steps are dropped, attempts replay in order."""

from __future__ import annotations

import numpy as np
import pytest

from recsys.train.rows import ROWS_DIR, RowRecorder, attempt_name, check_exactly_once, consumed


def _attempt(run_dir, start, steps_by_rank):
    """Record an attempt that resumed from ``start``: {rank: [(epoch, step, [row ids])]}."""
    name = attempt_name(run_dir / ROWS_DIR, start)
    for rank, steps in steps_by_rank.items():
        rec = RowRecorder(run_dir, name, rank)
        for epoch, step, ids in steps:
            rec.record(epoch, step, np.asarray(ids, dtype=np.int64))
        rec.close()
    return name


def test_a_resume_drops_the_steps_it_rolled_back(tmp_path):
    # attempt 0 trains steps 1-3 on two ranks and dies; it had a checkpoint at step 2
    _attempt(tmp_path, 0, {0: [(0, 1, [0, 1]), (0, 2, [2, 3]), (0, 3, [4, 5])],
                           1: [(0, 1, [10, 11]), (0, 2, [12, 13]), (0, 3, [14, 15])]})
    # attempt 1 resumes from step 2 at one rank: step 3 is redone with other rows, then epoch 1
    _attempt(tmp_path, 2, {0: [(0, 3, [4, 5, 14, 15]), (1, 4, [0, 1, 2, 3, 4]), (1, 5, [5, 10, 11, 12, 13, 14, 15])]})
    got = consumed(tmp_path)
    assert sorted(got) == [0, 1]
    ids = [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]
    assert sorted(got[0].tolist()) == ids  # step 3 of attempt 0 was dropped: no repeats
    assert sorted(got[1].tolist()) == ids
    report = check_exactly_once(tmp_path, np.array(ids), epochs=2)
    assert report["ok"], report


def test_a_row_seen_twice_or_never_is_reported(tmp_path):
    _attempt(tmp_path, 0, {0: [(0, 1, [0, 1]), (0, 2, [1, 2])]})
    report = check_exactly_once(tmp_path, np.arange(4), epochs=1)
    assert not report["ok"]
    assert report["epochs"][0] == {"rows": 4, "missing": 1, "repeated": 1, "foreign": 0}


def test_an_attempt_resuming_from_an_older_checkpoint_rolls_back_more(tmp_path):
    _attempt(tmp_path, 0, {0: [(0, 1, [0]), (0, 2, [1]), (0, 3, [2])]})
    _attempt(tmp_path, 3, {0: [(0, 4, [3]), (0, 5, [4])]})
    _attempt(tmp_path, 1, {0: [(0, 2, [1]), (0, 3, [2]), (0, 4, [3]), (0, 5, [4])]})  # latest was lost
    report = check_exactly_once(tmp_path, np.arange(5), epochs=1)
    assert report["ok"], report


def test_no_recorded_rows_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="record_rows"):
        consumed(tmp_path)


def test_record_rows_without_row_id_passthrough_is_a_config_error(tiny_data, tmp_path):
    from recsys.config import ConfigError
    from test_train import build

    with pytest.raises(ConfigError, match="row_id in data.train.passthrough"):
        build(tiny_data, tmp_path / "run", "train.record_rows=true")


def test_a_training_run_records_every_row_once(tiny_data, tmp_path):
    from test_faults import assert_exactly_once
    from test_train import run

    run(tiny_data, tmp_path / "run", "train.record_rows=true", "data.train.passthrough=['row_id']", "train.epochs=2")
    report = assert_exactly_once(tmp_path / "run", tiny_data, epochs=2)
    assert report["epochs"][0]["rows"] == report["epochs"][1]["rows"] > 0


def test_a_skipped_file_is_counted_and_the_other_rows_train_once(tiny_data, tmp_path):
    """on_bad_file = "skip": the truncated file is read past, counted in every epoch_end event,
    and the rows of the other files are each trained once per epoch."""
    import json
    import shutil

    from recsys.testing.faults import train_row_ids_of
    from recsys.train.rows import check_exactly_once
    from test_train import run

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    files = sorted((data / "train").glob("*.parquet"))
    files[0].write_bytes(files[0].read_bytes()[:1000])
    run(data, tmp_path / "run", "train.record_rows=true", "data.train.passthrough=['row_id']", "train.epochs=2",
        "data.train.on_bad_file='skip'")
    ends = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if '"epoch_end"' in line]
    assert [(e["epoch"], e["skipped_files"], e["skipped_row_groups"]) for e in ends] == [(0, 1, 0), (1, 1, 0)]
    good = np.concatenate([train_row_ids_of(f) for f in files[1:]])
    report = check_exactly_once(tmp_path / "run", good, epochs=2)
    assert report["ok"], report
