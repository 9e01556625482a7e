"""``recsys bench defaults``: the library's defaults against the previous ones, per data set.

A new user's job names its data, schema and model, and leaves most learning settings at
the library's defaults. This bench asks whether the defaults of ``STUDIED`` are good ones:
each set of ``recsys bench quality`` (``recsys.bench.quality``) keeps its job file except
those keys, which are removed (``bare_job``), and is trained once per candidate:

    defaults   no setting added: the library's defaults as they are now
    previous   the values those keys had as defaults before (``PREVIOUS``), set explicitly

(``candidates`` takes others: a label and its ``--set`` overrides; the first is compared
with each of the others: first − other). Everything else (arch, towers, batch size, epochs, early
stopping on the validation split, the eval split scored at the kept checkpoint) is the
job's own, exactly as ``recsys bench quality`` trains it.

Repetitions, paired: a set whose eval split holds fewer than ``quality.SMALL_EVAL`` rows
(fair, randhie, bikeshare) is scored on ``splits`` random splits (split k: shuffled and
trained with seed k, as ``quality.repeated``); flights on split 0 with seeds 0, 1, 2; the
synthetic set with seed 0 (``SYNTHETIC_SEEDS``). The figure per set is the paired difference in eval AUC (the
first candidate − another), its mean and 95 % Student-t interval (``quality.paired_difference``).

``--quick``: the tiny synthetic set and fair, one repetition each, two epochs: the shape of
the output, not the figures.
"""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path

import numpy as np

from recsys.bench import quality

STUDIED = ("schema.dense_transform", "store.lr", "store.initial_accumulator")
"""The job keys whose library default this bench judges (removed from each set's job)."""
PREVIOUS = {"schema.dense_transform": "signed_log1p", "store.lr": 0.01, "store.initial_accumulator": 0.0}
"""Their defaults before 2026-11-27."""
SETS_RUN = ("synthetic", "randhie", "fair", "bikeshare", "flights")
QUICK_SETS = ("synthetic", "fair")
SPLITS = 5
SEEDS = (0, 1, 2)
SYNTHETIC_SEEDS = (0,)
"""The synthetic set trains with one seed: up to 6 epochs of 1.7 M rows a run. Its own jobs
name their transform (the generator is linear in ``signed_log1p``); here it only checks that
the defaults do no harm on data of that kind."""


def overrides_of(values: dict) -> list[str]:
    """Return ``--set`` overrides for ``{job key: value}`` (values written as TOML)."""
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def bare_job(job_path: Path, out_dir: Path, keys: tuple[str, ...] = STUDIED) -> Path:
    """Write ``job_path`` without ``keys`` (dotted job keys) to ``out_dir``; return its path."""
    import tomli_w

    data = tomllib.loads(Path(job_path).read_text())
    for key in keys:
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{Path(job_path).stem}-bare.toml"
    out.write_text(f"# {job_path} without {', '.join(keys)} (recsys bench defaults)\n" + tomli_w.dumps(data))
    return out


def _units(name: str, quick: bool, data: Path | None, splits: int) -> list[tuple[str, int, list[str]]]:
    """Return the repetitions of set ``name``: (label, seed, overrides pointing at its split)."""
    if name == "synthetic":
        _, _, overrides, _ = quality._synthetic(quick, data)
        return [(f"seed {k}", k, overrides) for k in (SEEDS[:1] if quick else SYNTHETIC_SEEDS)]
    s = quality.SETS[name]
    root = quality.prepare(s)
    if quick:
        return [("split 0", 0, quality.split_overrides(root) + [f"train.epochs={quality.QUICK_EPOCHS}"])]
    if quality._read_split([str(root / "eval")], ["label"])["label"].shape[0] >= quality.SMALL_EVAL:
        return [(f"seed {k}", k, quality.split_overrides(root)) for k in SEEDS]
    return [(f"split {k}", k, quality.split_overrides(quality.prepare(s, split=k))) for k in range(splits)]


def _job_of(name: str, quick: bool, data: Path | None) -> Path:
    return quality._synthetic(quick, data)[0] if name == "synthetic" else quality.ROOT / quality.SETS[name].job


def measure(quick: bool, data: Path | None = None, sets: tuple[str, ...] | None = None,
            candidates: dict[str, list[str]] | None = None, splits: int | None = None,
            threads: int | None = None, log=print) -> dict:
    """Train every set's bare job once per candidate and repetition; return the figures."""
    quality.require_extra("defaults", sets or (QUICK_SETS if quick else SETS_RUN))
    candidates = candidates or {"defaults": [], "previous": overrides_of(PREVIOUS)}
    labels = list(candidates)
    if len(labels) < 2:
        raise ValueError(f"bench defaults: give at least two candidates to compare, found {labels}")
    splits = SPLITS if splits is None else splits
    if splits < 2 and not quick:
        raise ValueError(f"bench defaults: splits must be >= 2 for a paired interval, found {splits}")
    if threads is None and quick:
        threads = quality.QUICK_THREADS
    out_root = quality.RUNS / ("defaults-quick" if quick else "defaults") / time.strftime("%Y%m%d-%H%M%S")
    results, comparisons = {}, []
    for name in sets or (QUICK_SETS if quick else SETS_RUN):
        job = bare_job(_job_of(name, quick, data), out_root / "jobs")
        runs = []
        for unit, seed, overrides in _units(name, quick, data, splits):
            if threads is not None:
                overrides = [*overrides, f"train.runtime.threads={threads}"]
            row = {"unit": unit}
            for label in labels:
                run_dir = out_root / name / unit.replace(" ", "-") / label.replace(" ", "-")
                row[label] = quality.train_ours(job, seed, run_dir, [*overrides, *candidates[label]])
            runs.append(row)
            log(f"defaults {name} {unit}: " + "  ".join(f"{m} {row[m]['auc']:.4f}" for m in labels))
        auc = {m: [r[m]["auc"] for r in runs] for m in labels}
        diffs = {f"{labels[0]} - {m}": quality.paired_difference(auc[labels[0]], auc[m]) for m in labels[1:]}
        results[name] = {"job": str(job), "runs": runs, "auc_mean": {m: float(np.mean(v)) for m, v in auc.items()},
                         "differences": diffs}
        for m in labels[1:]:
            d = diffs[f"{labels[0]} - {m}"]
            a, b = results[name]["auc_mean"][labels[0]], results[name]["auc_mean"][m]
            comparisons.append({"name": f"{name}: eval AUC, {labels[0]} vs {m}, paired over {d['splits']}",
                                "ours": a, "baseline": b, "ratio": a / b, "unit": "AUC", "difference": d["mean"],
                                "interval_95": [d["low"], d["high"]]})
    return {"sets": results, "comparisons": comparisons, "candidates": candidates, "studied": list(STUDIED),
            "runs_dir": str(out_root)}
