"""The tiny synthetic set with a per-example weight column, and a trained checkpoint of it,
shared by the tests of weighted training and weighted ``recsys eval``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "synthetic_tiny.toml"


def random_weights(n: int, seed: int) -> np.ndarray:
    """Weights of every kind a job meets: exponential, a tenth 0, some integers, float32."""
    rng = np.random.default_rng(seed)
    w = rng.exponential(1.0, n)
    w[rng.random(n) < 0.1] = 0.0
    whole = rng.random(n) < 0.2
    w[whole] = rng.integers(1, 4, int(whole.sum()))
    return w.astype(np.float32)


def add_weights(src: Path, out: Path, weights=random_weights, seed: int = 0, column: str = "w") -> Path:
    """Copy every Parquet file of ``src`` to ``out`` (same names, 500-row groups) with a weight
    column ``column`` = ``weights(rows, seed + file index)`` (an array) appended; return ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(sorted(Path(src).glob("*.parquet"))):
        table = pq.read_table(f)
        table = table.append_column(column, pa.array(weights(table.num_rows, seed + i)))
        pq.write_table(table, out / f.name, row_group_size=500)
    return out


def ones(n: int, seed: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def overrides(train: Path, eval_: Path, *extra: str) -> list[str]:
    return [f"data.train.paths=['{train}']", f"data.eval.paths=['{eval_}']", "data.train.batch_size=256",
            "data.eval.batch_size=512", "train.log_every=1", "train.schedule.warmup_steps=0", "train.progress='none'",
            *extra]


def train(run_dir: Path, train_dir: Path, eval_dir: Path, *extra: str, job=None, source=None) -> dict:
    """Train ``jobs/synthetic_tiny.toml`` (or ``job``) in this process on the given splits; return the result."""
    from recsys.config import load_job
    from recsys.train.loop import Trainer, setup_env

    job = job or load_job(JOB, overrides(train_dir, eval_dir, *extra))
    trainer = Trainer(job, run_dir, setup_env("cpu"), source=source)
    try:
        return trainer.train()
    finally:
        trainer.close()
