"""Settings of the embedding store's tables (no torch, no numba: the CLI imports it early)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from recsys.redis_util import URL_SCHEMES as SPILL_SCHEMES  # one list of Redis URL forms

OPTIMIZERS = ("rowwise_adagrad", "adagrad", "adam", "sgd")
DTYPES = ("float32", "float16")
MAX_MIN_COUNT = 255  # admission counters are saturating uint8


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """How every table of the store keeps, initializes, admits and updates its rows."""

    optimizer: Literal["rowwise_adagrad", "adagrad", "adam", "sgd"] = "rowwise_adagrad"
    """Sparse optimizer applied to the touched rows (see ``recsys.store.optim``)."""
    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-8
    """Added to the denominator of Adagrad / row-wise Adagrad / Adam."""
    beta1: float = 0.9
    """Adam: decay of the first moment."""
    beta2: float = 0.999
    """Adam: decay of the second moment."""
    weight_decay: float = 0.0
    """L2 penalty: ``weight_decay * w`` is added to a touched row's gradient (torch's convention)."""
    initial_accumulator: float = 0.0
    """Adagrad / row-wise Adagrad: starting value of a new row's squared-gradient sum."""
    init_scale: float | None = None
    """New rows are drawn from U(-a, a) with ``a = init_scale``; unset: ``a = 1/sqrt(dim)``."""
    min_count: int = 1
    """Admission: a new key gets a row on its ``min_count``-th sighting (1 = admit at once)."""
    dtype: Literal["float32", "float16"] = "float32"
    """Storage type of embeddings; the math and the optimizer state are always float32."""
    seed: int = 0
    """Seed of the initial vectors (with the table name and the key, nothing else)."""
    staleness: int = 0
    """Lookups of step t see the pushes of steps <= t - staleness - 1, exactly (0: synchronous)."""
    device_cache_rows: int = 0
    """Rows per table and shard cached on the compute device, write-back (0: no device cache)."""
    spill_url: str = ""
    """Redis URL of the spill tier keeping evicted rows, e.g. ``redis://host:6379/0`` ("": none)."""
    spill_namespace: str = "recsys"
    """Prefix of spill keys: ``<namespace>:spill:<table>:<key as 16 hex digits>``."""
    spill_batch_rows: int = 1000
    """Keys per Redis command (MSET / MGET / UNLINK) of the spill tier."""
    spill_queue_rows: int = 100_000
    """Evicted rows buffered for the background writer; evictions wait while it is full."""
    spill_retries: int = 3
    """Retries of a failed Redis call (after the first attempt) before ``SpillError``."""
    spill_backoff_s: float = 0.05
    """Wait before the first retry; doubled before each further one."""
    spill_timeout_s: float = 5.0
    """Socket timeout of one Redis call (connect, send, reply)."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, found {self.optimizer!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, found {self.dtype!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, found {self.lr}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be a finite number > 0, found {self.eps}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), found {value}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, found {self.weight_decay}")
        if not (math.isfinite(self.initial_accumulator) and self.initial_accumulator >= 0):
            raise ValueError(
                f"initial_accumulator must be a finite number >= 0, found {self.initial_accumulator}"
            )
        if self.init_scale is not None and not (math.isfinite(self.init_scale) and self.init_scale >= 0):
            raise ValueError(f"init_scale must be a finite number >= 0 when set, found {self.init_scale}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, found {self.staleness}")
        if not 1 <= self.min_count <= MAX_MIN_COUNT:
            raise ValueError(f"min_count must be in [1, {MAX_MIN_COUNT}], found {self.min_count}")
        if self.device_cache_rows < 0:
            raise ValueError(f"device_cache_rows must be >= 0 (0: no device cache), found {self.device_cache_rows}")
        if self.spill_url and not self.spill_url.startswith(SPILL_SCHEMES):
            raise ValueError(
                f"spill_url must start with one of {list(SPILL_SCHEMES)} (or be empty: no spill tier), "
                f"found {self.spill_url!r}"
            )
        if not self.spill_namespace or any(ch.isspace() for ch in self.spill_namespace):
            raise ValueError(f"spill_namespace must be non-empty without whitespace, found {self.spill_namespace!r}")
        if not 1 <= self.spill_batch_rows <= 100_000:
            raise ValueError(f"spill_batch_rows must be in [1, 100000], found {self.spill_batch_rows}")
        if self.spill_queue_rows < self.spill_batch_rows:
            raise ValueError(
                f"spill_queue_rows must be >= spill_batch_rows ({self.spill_batch_rows}), found {self.spill_queue_rows}"
            )
        if not 0 <= self.spill_retries <= 20:
            raise ValueError(f"spill_retries must be in [0, 20], found {self.spill_retries}")
        if not (math.isfinite(self.spill_backoff_s) and 0 <= self.spill_backoff_s <= 60):
            raise ValueError(f"spill_backoff_s must be in [0, 60] seconds, found {self.spill_backoff_s}")
        if not (math.isfinite(self.spill_timeout_s) and self.spill_timeout_s > 0):
            raise ValueError(f"spill_timeout_s must be a finite number > 0, found {self.spill_timeout_s}")

    def spill_retry_budget_s(self) -> float:
        """Return the longest a spill call waits in backoff before ``SpillError`` (timeouts excluded)."""
        return self.spill_backoff_s * (2**self.spill_retries - 1)

    def init_bound(self, dim: int) -> float:
        """Return ``a`` of the initial distribution U(-a, a) for a table of width ``dim``."""
        return self.init_scale if self.init_scale is not None else 1.0 / math.sqrt(dim)
