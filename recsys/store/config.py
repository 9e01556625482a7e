"""Settings of the embedding store: ``[store]`` and its sections ``[store.spill]``, ``[store.device]``,
``[store.host]`` (no torch, no numba: the CLI imports it early)."""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from typing import Literal

from recsys.redisio.client import check_url

OPTIMIZERS = ("rowwise_adagrad", "adagrad", "adam", "sgd")
DTYPES = ("float32", "float16")
MAX_MIN_COUNT = 255  # admission counters are saturating uint8
SPILL_OUTAGE = ("fail", "hold")


@dataclass(kw_only=True, slots=True)
class SpillConfig:
    """The spill tier (``recsys.store.spill``): where evicted rows go, and how Redis calls fail."""

    url: str = ""
    """Redis URL of the spill tier keeping evicted rows, e.g. ``redis://host:6379/0`` ("": none).
    A password in the URL is used but never saved (the run's ``config.toml`` and checkpoints
    keep the URL without it): a resumed run takes it from ``password_file`` or
    ``$REDIS_PASSWORD``."""
    password_file: str = ""
    """File holding the spill Redis's password, for a ``url`` without one (else
    ``$REDIS_PASSWORD``; neither: no password)."""
    namespace: str = ""
    """Prefix of spill keys: ``<namespace>:spill:<table>:<key as 16 hex digits>``.

    Empty (the default): one namespace per run, ``recsys-<job name>-<12 hex digits of the
    run directory's absolute path>`` (``run_namespace``), the same for every rank and every
    restart or resume of that run directory, and no other run's. A store or table built
    outside a training run gets a temporary namespace of its own (deleted when it closes).
    A run writes ``<namespace>:owner`` (its run directory and job) at start and refuses a
    namespace another run owns (see ``takeover``); it deletes its own tables' spilled
    rows at start, since the checkpoint it resumes from holds every spilled row."""
    takeover: bool = False
    """Take over a namespace another run owns: replace its owner record and delete this
    job's tables' rows in it (other keys under the namespace are left alone)."""
    outage: Literal["fail", "hold"] = "fail"
    """What a Redis outage does once ``retries`` are used up. ``"fail"``: the call
    raises ``SpillError`` (the training job ends with one line naming Redis, what failed and
    the latest complete checkpoint, which holds every spilled row). ``"hold"``: training
    goes on; evicted rows stay in memory (and are served from there) until Redis is back,
    rows never spilled are initialized as usual, and only a read of a row that is in
    Redis alone (or a checkpoint, which needs every row) waits for Redis. Either way no
    spilled row is lost or re-initialized."""
    hold_timeout_s: float = 240.0
    """``"hold"``: how long an outage may last before the next call raises ``SpillError``
    after all. Keep it below ``train.runtime.collective_timeout_s`` with several ranks: a
    rank waiting for Redis holds up the others' collectives."""
    hold_max_rows: int = 1_000_000
    """``"hold"``: evicted rows (and deletions) held in memory during an outage before the
    next eviction raises ``SpillError`` (a row takes its spilled size, ~24 + D·4·k bytes)."""
    delete_restored: bool = False
    """Delete a row's Redis copy when a miss brings the row back into memory, so Redis holds
    only the rows not in memory. False (the default): the copy stays, never read while the
    row is in memory and overwritten when the row is evicted again, so Redis holds every row
    evicted at least once (up to one per id) and a step with spill sends no UNLINK per
    restored row, which is faster (BENCHMARKS.md, "Scale")."""
    batch_rows: int = 1000
    """Keys per Redis command (MSET / MGET / UNLINK) of the spill tier."""
    queue_rows: int = 100_000
    """Evicted rows buffered for the background writer; evictions wait while it is full."""
    retries: int = 3
    """Retries of a failed Redis call (after the first attempt) before ``SpillError``."""
    backoff_s: float = 0.05
    """Wait before the first retry; doubled before each further one."""
    timeout_s: float = 5.0
    """Socket timeout of one Redis call (connect, send, reply)."""

    def __post_init__(self) -> None:
        if self.url:
            check_url(self.url, "store.spill.url (or empty: no spill tier)")
        # braces: a Redis Cluster hash tag (every spilled row in one slot), and the published row
        # keys' mark: a gc's pattern ns:{version:* could match a spill key
        if any(ch.isspace() for ch in self.namespace) or any(ch in self.namespace for ch in "*?[]\\{}"):
            raise ValueError(
                "namespace must have no whitespace and no glob characters (* ? [ ] \\), no braces (Redis "
                f"Cluster hash tags), or be empty (one per run), found {self.namespace!r}"
            )
        if self.outage not in SPILL_OUTAGE:
            raise ValueError(f"outage must be one of {list(SPILL_OUTAGE)}, found {self.outage!r}")
        if not (math.isfinite(self.hold_timeout_s) and self.hold_timeout_s > 0):
            raise ValueError(f"hold_timeout_s must be a finite number > 0, found {self.hold_timeout_s}")
        if not 1 <= self.batch_rows <= 100_000:
            raise ValueError(f"batch_rows must be in [1, 100000], found {self.batch_rows}")
        if self.queue_rows < self.batch_rows:
            raise ValueError(f"queue_rows must be >= batch_rows ({self.batch_rows}), found {self.queue_rows}")
        if self.hold_max_rows < self.queue_rows:
            raise ValueError(
                f"hold_max_rows must be >= queue_rows ({self.queue_rows}), found {self.hold_max_rows}"
            )
        if not 0 <= self.retries <= 20:
            raise ValueError(f"retries must be in [0, 20], found {self.retries}")
        if not (math.isfinite(self.backoff_s) and 0 <= self.backoff_s <= 60):
            raise ValueError(f"backoff_s must be in [0, 60] seconds, found {self.backoff_s}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, found {self.timeout_s}")

    def retry_budget_s(self) -> float:
        """Return the longest a spill call waits in backoff before ``SpillError`` (timeouts excluded)."""
        return self.backoff_s * (2**self.retries - 1)

    def namespace_for(self, run_dir: str | os.PathLike, job_name: str) -> str:
        """Return the namespace this config spills to in the run at ``run_dir`` (see
        ``namespace``): the configured one, else ``run_namespace(run_dir, job_name)``."""
        return self.namespace or run_namespace(run_dir, job_name)


@dataclass(kw_only=True, slots=True)
class DeviceConfig:
    """The device tiers (``recsys.store.device``): rows kept in the compute device's memory."""

    cache_rows: int = 0
    """Rows per table and shard cached on the compute device, write-back (0: no device cache).
    On a GPU with one process, every table cached: rows are gathered, pooled and updated on
    the GPU, and only the misses cross from the host (the GPU tier; docs/ARCHITECTURE.md)."""
    memory_gb: float = 0.0
    """Device memory for the tables' rows and optimizer state, in GiB (0: unused). Each
    table and shard gets a device cache: its whole capacity when every table fits, else a
    share of the budget in proportion to its capacity. Exclusive with ``cache_rows``."""
    key_map: Literal["host", "device"] = "host"
    """Where a training step's key work runs. ``"host"`` (the default): the host tables' key
    maps (numba), whatever the device tiers. ``"device"``: every table's keys, rows and
    optimizer in one index and arena on the compute device (``recsys.store.device.keymap``);
    only the batch's keys and lengths cross, once a step. It needs one process, every table
    whole on the device (``memory_gb`` or ``cache_rows`` holding every capacity) or
    ``cache_rows`` set (a table above it keeps its ``cache_rows`` most recent rows on the
    device, exact LRU, in front of a host table of the rest: ``recsys.store.device.cached``;
    the host is asked for each step's misses one step ahead), float32 rows, ``min_count = 1``,
    one dim, ``staleness = 0``, no spill tier and no live publishing; a job that has any
    other is refused with a line naming it. Its checkpoints are the host store's, either way
    round."""

    def __post_init__(self) -> None:
        if self.key_map not in ("host", "device"):
            raise ValueError(f"key_map must be 'host' or 'device', found {self.key_map!r}")
        if self.cache_rows < 0:
            raise ValueError(f"cache_rows must be >= 0 (0: no device cache), found {self.cache_rows}")
        if not (math.isfinite(self.memory_gb) and self.memory_gb >= 0):
            raise ValueError(f"memory_gb must be a number >= 0 (0: unused), found {self.memory_gb}")
        if self.memory_gb and self.cache_rows:
            raise ValueError("set cache_rows (rows per table) or memory_gb (a budget for all "
                             f"tables), not both; found {self.cache_rows} and {self.memory_gb}")


@dataclass(kw_only=True, slots=True)
class HostConfig:
    """How the store uses the host's memory and cores (``recsys.store.host``, the store's worker
    and its helper threads): none of these changes a number the store computes."""

    prefault: bool = True
    """Commit every table's memory (rows, optimizer state, key map) when the store is built,
    as fbgemm's TBE does when it initializes its weights, so that no training step pays the
    first-touch page faults of the rows it inserts: they are a sizeable share of a step,
    and their price varies from host to host (docs/benchmarks-history.md,
    "Figures from module docstrings"). False: memory is committed as rows arrive (resident memory
    grows with the rows held; build time is shorter)."""
    huge_pages: bool = True
    """Keep every table's large arrays (rows, optimizer state, key map) on the kernel's 2 MiB
    pages where Linux allows it (``recsys.store.host.pages``): the store's kernels read and write
    rows at random, and on 4 KiB pages nearly every such access also misses the TLB. The
    numbers are the same either way. False: ordinary pages."""
    threads: int = 1
    """Threads of the store's per-table work (key lookups and inserts, row reads, the pooling
    backward and the optimizer): the store's worker and ``threads - 1`` helpers; 0: torch's
    intra-op thread count when the store is built. The numbers are the same for any count
    (tables share no arrays); only tables without a spill tier or device cache use helpers.
    More threads pay when the store's work is what the caller waits for (the store bench's
    train step runs 2; BENCHMARKS.md has both counts). In ``recsys train`` on 2 cores the
    dense model's threads need both cores while the store works, and 2 store threads were
    slower there, so 1 is the default."""
    waiter_helps: bool = True
    """A thread waiting for the store's worker (the trainer, after its dense optimizer step,
    for the next lookup) takes tables of the worker's current call (the push's optimizer,
    the row reads) instead of idling, one table at a time, largest first. The numbers are
    the same whoever runs a table. Threaded CPU stores whose tables have no spill tier or
    device cache only."""
    keep_freed_memory: bool = True
    """Set glibc's malloc to keep freed memory for reuse (``recsys.store.host.malloc``), process-wide,
    when a store is built: a step's large arrays (rows, pooled embeddings, gradients) then
    reuse last step's memory instead of paying fresh page faults, which made the store's
    rounds markedly slower and host-dependent. The process keeps up to 1 GiB of freed
    memory. False: leave malloc as it is."""

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: torch's intra-op thread count), found {self.threads}")


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    """How every table of the store keeps, initializes, admits and updates its rows.

    The keys at this level are read by every part of the store: the optimizer and its
    settings decide a row's state columns, hence the layout of the host tables, the device
    tiers, the spill records and the checkpoints alike. The sections hold what one part
    reads: ``spill`` (the spill tier), ``device`` (the device tiers), ``host`` (the host's
    memory and threads)."""

    optimizer: Literal["rowwise_adagrad", "adagrad", "adam", "sgd"] = "rowwise_adagrad"
    """Sparse optimizer applied to the touched rows (see ``recsys.store.tables.optim``)."""
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
    spill: SpillConfig = field(default_factory=SpillConfig)
    """The spill tier: evicted rows kept in Redis (off unless ``url`` is set)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    """The device tiers: rows cached on (or held whole by) the compute device."""
    host: HostConfig = field(default_factory=HostConfig)
    """The host's memory and threads as the store uses them."""

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


def run_namespace(run_dir: str | os.PathLike, job_name: str) -> str:
    """Return the spill namespace of the run at ``run_dir``: ``recsys-<job>-<hash>``, the hash
    being 12 hex digits of SHA-256 of the directory's absolute path (stable across restarts
    and resumes of the run directory, distinct between run directories)."""
    path = os.path.abspath(os.fspath(run_dir))
    digest = hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", job_name)[:40] or "job"
    return f"recsys-{job}-{digest}"
