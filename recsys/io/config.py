"""Settings of the Parquet streaming reader (no torch here: the CLI imports it early)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True, slots=True)
class ReaderConfig:
    """How a data split is read: where, in what batches, shuffled how, by how many workers."""

    paths: list[str] = field(default_factory=list)
    """Files, directories or globs; local paths or any pyarrow filesystem URI."""
    filter: str = ""
    """Select files by their Hive partition directories (``date=2026-11-01/...``), e.g.
    ``"date >= '2026-11-01' and region in ('eu', 'us')"`` (grammar: ``recsys.io.partitions``)."""
    batch_size: int = 4096
    """Rows per batch (per rank)."""
    shuffle: bool = True
    """Shuffle work units (and rows within them) per epoch, by seed."""
    shuffle_buffer: int = 4
    """Row groups open at once per worker; rows are drawn at random across them (1 = none).
    As many more are loaded ahead, so memory is about 2 × this many converted row groups."""
    seed: int = 0
    """Seed of every shuffle; epoch e uses (seed, e)."""
    num_workers: int = 0
    """Worker processes per rank (0 = read in a background thread of the calling process).
    They start with the reader's first epoch and stay until it closes (a new process faults
    in every page it writes, a sizeable share of an epoch's time)."""
    prefetch: int = 2
    """Batches read ahead (the thread: queued; each worker: ``prefetch + 2`` in flight)."""
    drop_last: bool = False
    """Drop each worker's final short batch (its rows are then counted as not yet read)."""
    passthrough: list[str] = field(default_factory=list)
    """Extra columns carried into batches untouched (e.g. ``row_id``)."""
    on_bad_file: Literal["error", "skip"] = "error"
    """On a corrupt, truncated, empty or ill-typed file: stop with an error, or skip it (counted and logged)."""
    arrow_threads: bool = True
    """Let Arrow decode columns with its thread pool (worker processes split the cores)."""
    nice: int = 10
    """Raise the reader's threads' (and worker processes') nice value by this much (Linux;
    0..19), so reading ahead only takes CPU the training step leaves idle."""
    holdout_fraction: float = 0.0
    """Hold out this fraction of the row groups (whole row groups, chosen by a stable hash of
    each one's file key and index with ``holdout_seed``; the same choice on every host and
    world size). ``train.eval.validation_fraction`` sets it for the training and validation reads."""
    holdout: Literal["exclude", "only"] = "exclude"
    """With ``holdout_fraction``: read every row group but the held-out ones, or only them."""
    holdout_seed: int = 0
    """Seed of the held-out choice."""
    holdout_fold: int = 0
    """Hold out the fold-th slice of that hash order instead of the first (``recsys tune
    --cv K``: fraction 1/K, folds 0..K-1 hold out every row group exactly once)."""
    start_method: Literal["fork", "forkserver", "spawn"] = "fork"
    """How worker processes start (``num_workers > 0``). fork starts at once; forkserver and
    spawn re-import torch (far slower to start) but are safer if other threads of the process
    may hold locks at fork time (e.g. another reader streaming in a background thread)."""

    def __post_init__(self) -> None:
        from recsys.io.partitions import parse_filter

        parse_filter(self.filter)  # a mistake fails when the job is loaded, naming where
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, found {self.batch_size}")
        if self.shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, found {self.shuffle_buffer}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, found {self.num_workers}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be in 0..19, found {self.nice}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in [0, 1), found {self.holdout_fraction}")
        if self.holdout_fold < 0 or (self.holdout_fold and self.holdout_fold * self.holdout_fraction >= 1 - 1e-9):
            raise ValueError(f"holdout_fold must be >= 0 and fold × holdout_fraction < 1, found fold "
                             f"{self.holdout_fold} of fraction {self.holdout_fraction}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, found {self.prefetch}")
