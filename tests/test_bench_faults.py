"""``recsys bench faults``: its verdicts. The checks a scenario ends with are fed runs that
must fail them (a row trained twice, a sparse row or the final evaluation off, a job that
crashed, a missing data path that trains anyway or answers with a traceback) and the same
runs intact, which must pass; one scenario (``clear_errors``: a missing data path under
``--nproc 2``) runs end to end; the command's exit code follows its scenarios."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import test_train as tt
from recsys.checkpoint import read as checkpoint_files
from recsys.bench import faults
from recsys.testing.harness import records


class FakeJob:
    """What a scenario reads of a launched ``recsys train``: its exit code, log and run directory."""

    def __init__(self, run_dir: Path, code: int = 0, log: str = "") -> None:
        self.run_dir, self.code, self.log = Path(run_dir), code, log

    def start(self) -> "FakeJob":
        return self

    def wait(self, timeout: float = 0) -> int:
        return self.code

    def log_tail(self, chars: int = 4000) -> str:
        return self.log[-chars:]

    def records(self) -> list[dict]:
        return records(self.run_dir)


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> Path:
    """One epoch of the tiny set with the row audit on, and its result.json as ``recsys train`` writes it."""
    run_dir = tmp_path_factory.mktemp("faults-verdicts") / "reference"
    result = tt.run(tiny_data, run_dir, "data.train.passthrough=['row_id']", "train.record_rows=true")
    (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return run_dir


def _scenarios(tmp_path: Path, data: Path, reference: Path) -> faults.Scenarios:
    s = faults.Scenarios(tmp_path / "out", data, epochs=1)
    s._references[0] = reference  # the uninterrupted run, already trained
    return s


def _one_row_changed(run_dir: Path) -> None:
    """One float of one row of table c1 one ulp up, in a checkpoint still complete (its marker
    lists the shard's new size)."""
    ckpt = checkpoint_files.latest(run_dir / "checkpoints")
    path = checkpoint_files.sparse_files(ckpt, "c1")[0]
    table = pq.read_table(path)
    emb = table.column("embedding").combine_chunks()
    values = emb.flatten().to_numpy().copy()
    values[0] = np.nextafter(values[0], np.float32(np.inf))  # one ulp of one row
    changed = pa.FixedSizeListArray.from_arrays(pa.array(values, type=emb.type.value_type), emb.type.list_size)
    pq.write_table(table.set_column(table.column_names.index("embedding"), "embedding", changed), path)
    marker = ckpt / checkpoint_files.MARKER
    complete = json.loads(marker.read_text())
    complete["files"][str(path.relative_to(ckpt))] = path.stat().st_size
    marker.write_text(json.dumps(complete))


def _another_evaluation(run_dir: Path) -> None:
    path = run_dir / "result.json"
    result = json.loads(path.read_text())
    result["auc"] += 1e-9
    path.write_text(json.dumps(result))


def _rank_file(run_dir: Path) -> Path:
    (path,) = (run_dir / "rows").glob("attempt-*/rank-*.i64")
    return path


def _a_row_trained_twice(run_dir: Path) -> None:
    path = _rank_file(run_dir)
    records = np.fromfile(path, dtype="<i8").reshape(-1, 3)
    np.concatenate([records, records[-1:]]).tofile(path)


def _a_row_never_trained(run_dir: Path) -> None:
    path = _rank_file(run_dir)
    np.fromfile(path, dtype="<i8").reshape(-1, 3)[:-1].tofile(path)


BREAKS = {
    "one-sparse-row-one-ulp-off": (_one_row_changed, 0),
    "another-final-evaluation": (_another_evaluation, 0),
    "a-row-trained-twice": (_a_row_trained_twice, 0),
    "a-row-never-trained": (_a_row_never_trained, 0),
    "the-job-exited-1": (None, 1),
}


def test_a_run_equal_to_the_uninterrupted_one_passes(tiny_data, reference, tmp_path):
    """The verdict of killed_worker, hung_worker, preemption and checkpoint_crash (``_finish``)
    on an exact copy of the reference: passed, every part of it."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    details: dict = {}
    assert _scenarios(tmp_path, tiny_data, reference)._finish(FakeJob(run_dir), 0, details) is True
    assert details["exit_code"] == 0 and details["rows"]["ok"] and details["result"]["ok"]
    assert details["rows"]["epochs"]["0"] == {"rows": 6000, "missing": 0, "repeated": 0, "foreign": 0}
    assert details["result"]["rows_differing"] == 0 and details["resumed"] == []


@pytest.mark.parametrize("name", list(BREAKS))
def test_a_run_that_differs_from_the_uninterrupted_one_fails(tiny_data, reference, tmp_path, name):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    breaks, code = BREAKS[name]
    if breaks is not None:
        breaks(run_dir)
    details: dict = {}
    assert _scenarios(tmp_path, tiny_data, reference)._finish(FakeJob(run_dir, code), 0, details) is False
    if code:
        assert details["exit_code"] == 1 and "rows" not in details
    elif name.startswith("a-row"):
        assert not details["rows"]["ok"] and details["result"]["ok"]
    else:
        assert details["rows"]["ok"] and not details["result"]["ok"]
        assert details["result"]["rows_differing"] == (1 if name.startswith("one-sparse") else 0)


def _missing(data: Path) -> str:
    return str(data / "no-such-dir")


CLEAR_ERRORS = {
    # name: (exit code, output, passed)
    "one-line-naming-the-path": (2, "recsys train: error: {missing}: no such file or directory\n", True),
    "it-trained-anyway": (0, "", False),
    "a-traceback": (1, "Traceback (most recent call last):\n  File \"x.py\"\nFileNotFoundError: {missing}\n", False),
    "two-lines": (2, "recsys train: error: {missing}: not found\nrecsys train: error: {missing}: not found\n", False),
    "a-line-naming-something-else": (2, "recsys train: error: the data is missing\n", False),
    "exit-code-1": (1, "recsys train: error: {missing}: no such file or directory\n", False),
}


@pytest.mark.parametrize("name", list(CLEAR_ERRORS))
def test_the_clear_errors_verdict(tiny_data, tmp_path, monkeypatch, name):
    code, output, passed = CLEAR_ERRORS[name]
    launched = []

    def job(run_dir, overrides, nproc=2, max_restarts=2, **_):
        launched.append((overrides, nproc))
        return FakeJob(run_dir, code, output.format(missing=_missing(tiny_data)))

    monkeypatch.setattr(faults, "TrainJob", job)
    result = faults.Scenarios(tmp_path / "out", tiny_data, epochs=1).clear_errors()
    assert result["passed"] is passed, result
    ((sets, nproc),) = launched
    assert nproc == 2 and f"data.train.paths=['{_missing(tiny_data)}']" in sets


@pytest.mark.multiproc
def test_the_clear_errors_scenario_end_to_end(tiny_data, tmp_path):
    """For real: `recsys train --nproc 2` on a missing data path, launched as the bench does."""
    result = faults.Scenarios(tmp_path / "out", tiny_data, epochs=1).clear_errors()
    assert result["passed"] is True, result
    assert result["figure"] == {"exit_code": 2, "lines": 1}
    assert _missing(tiny_data) in result["details"]["output"][0]


class FakeScenarios:
    """Every scenario of the plan passes, except those named in ``FAILING`` (a verdict of
    False) and ``BROKEN`` (an exception)."""

    FAILING: set = set()
    BROKEN: set = set()
    ran: list = []

    def __init__(self, out: Path, data: Path, epochs: int) -> None:
        assert epochs == 1  # --quick

    def __getattr__(self, name: str):
        def scenario(*args):
            FakeScenarios.ran.append(name)
            if name in self.BROKEN:
                raise RuntimeError(f"{name} broke")
            return {"name": f"{name}{list(args)}", "passed": name not in self.FAILING, "figure": {}, "details": {}}

        return scenario


@pytest.mark.parametrize("failing, broken, code", [
    (set(), set(), 0),
    ({"clear_errors"}, set(), 1),
    (set(), {"spill_outage"}, 1),
])
def test_the_command_fails_when_a_scenario_does(tiny_data, tmp_path, monkeypatch, capsys, failing, broken, code):
    from recsys.cli import main

    monkeypatch.setattr(faults, "ROOT", tmp_path)  # its output directory: not the checkout's
    monkeypatch.setattr(faults, "Scenarios", FakeScenarios)
    monkeypatch.setattr(FakeScenarios, "FAILING", failing)
    monkeypatch.setattr(FakeScenarios, "BROKEN", broken)
    monkeypatch.setattr(FakeScenarios, "ran", [])
    assert main(["bench", "faults", "--quick", "--data", str(tiny_data), "--json", str(tmp_path / "f.json")]) == code
    saved = json.loads((tmp_path / "f.json").read_text())
    assert saved["passed"] is (code == 0)
    assert {n for n in FakeScenarios.ran} == {"killed_worker", "hung_worker", "preemption", "checkpoint_crash",
                                              "spill_outage", "bad_data", "clear_errors", "elastic_nodes", "resize"}
    out = capsys.readouterr().out
    for sc in saved["scenarios"]:
        name = sc["name"].split("[")[0]
        assert sc["passed"] is not (name in failing | broken), sc
        assert f"{'FAIL' if name in failing | broken else 'PASS'}  {sc['name']}" in out
    for name in broken:
        (sc,) = [s for s in saved["scenarios"] if s["name"].startswith(name)]
        assert sc["details"] == {"error": f"{name} broke"}
