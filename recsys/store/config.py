"""Settings of the embedding store's tables (no torch, no numba: the CLI imports it early)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

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

    def init_bound(self, dim: int) -> float:
        """Return ``a`` of the initial distribution U(-a, a) for a table of width ``dim``."""
        return self.init_scale if self.init_scale is not None else 1.0 / math.sqrt(dim)
