"""``recsys bench reader``: our reader vs pyarrow's raw decode of the same files and columns.

- the limit: ``ParquetFile.iter_batches`` over every file with Arrow threads, decoding the
  schema's columns and converting nothing;
- ours: ``ParquetReader`` producing shuffled batches of hashed KJT + dense tensors, in the
  calling process (a background thread) and with 2 worker processes. These two readers are
  kept from run to run (each run reads one epoch), as a training job keeps its reader; a
  third side builds a new 2-worker reader per run, so its workers start and end in the run.

After one untimed round, each round runs the four once (the limit first in even rounds,
last in odd ones); the table gives the best run of each side and the median and min-max of the per-round ratios,
so a noisy neighbour hurts both sides of a round alike. Full size: the ``small`` synthetic set (generated if
missing); ``--quick``: a 300k-row set of the same shape.

Each run also records what it cost (``cost_per_run``, medians printed under the table): user
and system CPU seconds and minor page faults of this process and of its worker processes
(live ones read from /proc, ended ones from the reaped children's usage). A new worker
process faults in every page it writes; the system-CPU column shows what that costs here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow.parquet as pq

from recsys.bench import comparison, paired_ratio

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "synthetic_small.toml"


def _quick_preset():
    from recsys.io.synth import Preset

    return Preset(name="bench-quick", train_rows=300_000, eval_rows=1_000,
                  rows_per_file=100_000, row_group_size=65_536)


def ensure_data(quick: bool, data: Path | None) -> Path:
    """Return a synthetic data directory for the benchmark, generating it when missing."""
    from recsys.io import synth

    if data is not None:
        if not (Path(data) / "train").is_dir():
            raise FileNotFoundError(f"{data}: expected a data set directory with train/ inside")
        return Path(data)
    target = ROOT / ("bench-out/data/reader-quick" if quick else "data/synthetic_small")
    if not (target / "oracle.json").exists():
        print(f"generating {target} ...", flush=True)
        synth.generate(_quick_preset() if quick else "small", target)
    return target


def _raw_decode(files: list[str], columns: list[str], batch_size: int) -> int:
    rows = 0
    for f in files:
        for rb in pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=columns, use_threads=True):
            rows += rb.num_rows
    return rows


def _epoch(reader) -> int:
    rows = 0
    for batch in reader:
        rows += batch.size
    return rows


def _ours(reader_cfg, schema) -> int:
    """One epoch of a reader built for it (worker processes start, and end at the close)."""
    from recsys.io.reader import ParquetReader

    with ParquetReader(reader_cfg, schema) as reader:
        return _epoch(reader)


def measure(quick: bool, data: Path | None = None) -> dict:
    """Return rows/s of raw decode and of our reader (0 and 2 workers) on one data set."""
    import dataclasses

    import torch

    from recsys.config import load_job
    from recsys.io.reader import ParquetReader

    job = load_job(JOB)
    schema = job.schema
    root = ensure_data(quick, data)
    files = sorted(str(p) for p in (root / "train").glob("*.parquet"))
    columns = schema.columns()
    batch_size = job.data.train.batch_size
    # reading is all the machine does here: Arrow's pool decodes in parallel, as in the raw
    # decode it is compared with (training jobs decode in the reader's one low-priority thread)
    base = dataclasses.replace(job.data.train, paths=[str(root / "train")], passthrough=[], arrow_threads=True)
    workers = dataclasses.replace(base, num_workers=2)
    # a training job reads every epoch with one reader: its worker processes start once
    kept = {"reader, 0 workers": ParquetReader(dataclasses.replace(base, num_workers=0), schema),
            "reader, 2 workers": ParquetReader(workers, schema)}
    first = "reader, 2 workers, first epoch"
    names = [*kept, first]
    repeats = 3 if quick else 6
    times: dict[str, list[float]] = {"raw": [], **{k: [] for k in names}}
    costs: dict[str, list[dict]] = {k: [] for k in times}
    rows = {}
    torch.set_num_threads(2)
    try:
        for r in range(-1, repeats):  # round -1 warms up (numba's kernels load, the page cache fills, workers start)
            order = ["raw", *names] if r % 2 == 0 else [*names, "raw"]
            for name in order:
                before = _usage()
                t0 = time.perf_counter()
                if name == "raw":
                    rows[name] = _raw_decode(files, columns, batch_size)
                elif name == first:
                    rows[name] = _ours(workers, schema)
                else:
                    rows[name] = _epoch(kept[name])
                if r >= 0:
                    times[name].append(time.perf_counter() - t0)
                    costs[name].append({k: round(v - before[k], 3) for k, v in _usage().items()})
    finally:
        for reader in kept.values():
            reader.close()
    best = {k: min(v) for k, v in times.items()}
    if len(set(rows.values())) != 1:
        raise RuntimeError(f"row counts differ between runs: {rows}")
    n = rows["raw"]
    raw_rate = n / best["raw"]
    return {
        "comparisons": [
            comparison(f"{name} vs raw iter_batches", n / best[name], raw_rate, "rows/s",
                       **({} if name == first else {"target_ratio": 0.7}), **paired_ratio(times[name], times["raw"]))
            for name in names
        ],
        "settings": {
            "data": str(root),
            "rows": n,
            "files": len(files),
            "row_groups": sum(pq.ParquetFile(f).metadata.num_row_groups for f in files),
            "columns": len(columns),
            "batch_size": batch_size,
            "shuffle_buffer": base.shuffle_buffer,
            "repeats": repeats,
            "cpu_threads": 2,
        },
        "seconds_best": best,
        "seconds_per_run": times,
        "cost_per_run": costs,
        "notes": [f"{name}: per run (median) {_median(costs[name], 'user_s'):.2f} s user + "
                  f"{_median(costs[name], 'sys_s'):.2f} s system CPU, "
                  f"{_median(costs[name], 'minor_faults') / 1000:.0f} k page faults (with worker processes)"
                  for name in times]
        + [f"'{first}' builds a new reader each run: its worker processes start and end within "
           "the run (no target: a job pays it once). The other readers are kept from run to run, "
           "as a training job keeps its reader from epoch to epoch."],
    }


def _usage() -> dict:
    """Return CPU seconds and minor page faults of this process, of its reaped children (a
    reader's workers are joined when it closes) and of its live children (a kept reader's
    workers, read from /proc). A child live at one reading and reaped by the next is counted
    right: its total then replaces its part."""
    import multiprocessing
    import resource

    out = {"user_s": 0.0, "sys_s": 0.0, "minor_faults": 0}
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        out["user_s"] += ru.ru_utime
        out["sys_s"] += ru.ru_stime
        out["minor_faults"] += ru.ru_minflt
    tick = os.sysconf("SC_CLK_TCK")
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile (reaped now, counted next time) or not Linux
            continue
        out["minor_faults"] += int(fields[7])
        out["user_s"] += int(fields[11]) / tick
        out["sys_s"] += int(fields[12]) / tick
    return out


def _median(runs: list[dict], key: str) -> float:
    import statistics

    return statistics.median(r[key] for r in runs)
