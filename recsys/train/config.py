"""Settings of the trainer and of its live pushes: ``[train]`` and its sections, ``[publish]`` (no
torch here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """The dense optimizer: what the trainer builds over the dense model's parameters."""

    name: Literal["adam", "adagrad"] = "adam"
    """Dense optimizer (torch's multi-tensor ``foreach`` implementation: the same numbers as
    its per-tensor loop, and faster on CPU)."""
    fused: bool = False
    """Use torch's fused dense optimizer kernel: faster again on CPU than ``foreach``, but
    its results differ from the default's in the last float bits (a run is still the same
    every time), so it is off unless chosen."""
    lr: float = 1e-3
    """Peak dense learning rate."""
    weight_decay: float = 0.0
    """Dense weight decay."""
    clip_grad_norm: float = 0.0
    """Clip the dense gradient's global norm (0: off)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, found {self.lr}")
        if self.clip_grad_norm < 0:
            raise ValueError(f"clip_grad_norm must be >= 0, found {self.clip_grad_norm}")


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    """The dense learning rate's schedule: a multiplier of ``optim.lr`` per step."""

    warmup_steps: int = 100
    """Linear warm-up from 0 to ``optim.lr`` over this many steps."""
    decay: Literal["none", "linear", "cosine"] = "none"
    """Decay after warm-up, down to ``optim.lr * min_lr_ratio`` at the last step (needs
    ``train.max_steps``, the step count)."""
    min_lr_ratio: float = 0.1
    """Floor of the decay, as a fraction of ``optim.lr``."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, found {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], found {self.min_lr_ratio}")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Periodic evaluations during training, and what they decide: the best checkpoint, early stopping."""

    every: int = 0
    """Evaluate every this many steps (0: only at the end) on the validation split
    (``data.validation``), or on the eval split when the job has no validation split."""
    every_epochs: int = 0
    """Also evaluate like that at the end of every this many epochs (0: off)."""
    max_rows: int = 0
    """Rows of the eval split used by periodic evaluations (0: all); the final one uses all."""
    keep_best: Literal["", "auc", "log_loss"] = ""
    """Keep the checkpoint with the best periodic evaluation by this metric as ``checkpoints/best``
    (never pruned by ``train.checkpoint.keep_last``; every ``--checkpoint`` accepts it). "": off."""
    early_stopping_patience: int = 0
    """Stop after this many periodic evaluations in a row without improvement (by ``keep_best``'s
    metric, AUC if unset). 0: off. A resume keeps the best so far and the count."""
    validation_fraction: float = 0.0
    """Carve the validation split out of the training files: this fraction of their row groups
    (whole row groups, chosen by a stable hash: never trained on, the same at every world size
    and on resume), read with ``data.validation``'s settings. Needs no ``data.validation``
    paths. The row groups held out are listed in ``RUN_DIR/validation.json``. 0: off."""

    def __post_init__(self) -> None:
        for name in ("every", "every_epochs", "max_rows", "early_stopping_patience"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, found {getattr(self, name)}")
        if (self.keep_best or self.early_stopping_patience) and not (self.every or self.every_epochs):
            raise ValueError("keep_best and early_stopping_patience need periodic evaluations: "
                             "set every (steps) or every_epochs")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in [0, 1), found {self.validation_fraction}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When the run writes checkpoints, and how many it keeps."""

    every_steps: int = 0
    """Checkpoint every this many steps (0: off)."""
    every_minutes: float = 0.0
    """Checkpoint every this many minutes (0: off)."""
    keep_last: int = 3
    """Complete checkpoints kept."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps must be >= 0, found {self.every_steps}")
        if self.every_minutes < 0:
            raise ValueError(f"every_minutes must be >= 0, found {self.every_minutes}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, found {self.keep_last}")


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """How the training processes run on their hosts: threads, cores, priorities, the
    exchange among local ranks and the collectives' timeout."""

    threads: int = 0
    """Torch intra-op threads per process (0: cores divided by local processes)."""
    optimizer_threads: int = 1
    """Torch intra-op threads of the dense optimizer's step (0: ``threads``). The step is
    elementwise, so any count gives the same numbers. It runs while the store's worker
    applies the sparse push on one of the cores, and a parallel region of ``threads``
    threads then waits for that core, which made the step several times slower with 2
    threads on 2 cores than with 1 (docs/benchmarks-history.md, "Figures
    from module docstrings"). Raise it for a dense model whose step is large enough to pay for it."""
    idle_background: bool = True
    """On CPU, run the store's worker and the reader's threads under Linux's ``SCHED_IDLE``
    policy while the dense forward and backward run, so they take only the cores the
    step's torch threads leave idle; they get the normal policy back whenever the step
    waits for them, and keep it while other processes use more than half a core of the
    host (``recsys.runtime.priority``). Off: they run at their nice values throughout."""
    pin_cores: bool = True
    """On CPU with several processes on this host (``--nproc > 1``), keep each process (every
    thread of it) on a share of its own of the host's allowed cores: local rank ``r`` of ``n``
    gets cores ``r*k`` to ``r*k + k - 1``, ``k`` = cores // ``n`` (nothing when there are
    fewer cores than processes, or on a GPU). Each rank's store worker and reader then use
    the idle moments of its own core instead of taking the other rank's mid-step, which the
    all-to-alls would make it wait for (``recsys.train.cores``). Off for two jobs of several
    processes on one host: both would take the same cores."""
    local_exchange: bool = True
    """Several processes on one host: the store's all-to-alls, the per-step control values
    and (CPU, up to 4 ranks) the dense gradients' mean go through shared memory in
    ``/dev/shm`` (``recsys.runtime.local_exchange``) instead of gloo's loopback TCP. Ranks on several
    hosts, or without a writable ``/dev/shm``, use gloo regardless."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective and rendezvous store wait of every process group: a hung or
    vanished peer is noticed after this long (gloo's default is 30 minutes), the process
    exits and ``--max-restarts`` can restart the job from its latest checkpoint."""

    def __post_init__(self) -> None:
        for name in ("threads", "optimizer_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, found {getattr(self, name)}")
        if not (math.isfinite(self.collective_timeout_s) and self.collective_timeout_s > 0):
            raise ValueError(f"collective_timeout_s must be a finite number > 0, found {self.collective_timeout_s}")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """How long and how the dense part trains, and what the run writes.

    The keys at this level are read by the training loop as a whole; the sections hold what
    one part of it reads: ``optim`` (the dense optimizer), ``schedule`` (its learning rate
    per step), ``eval`` (the periodic evaluations), ``checkpoint`` (when to save) and
    ``runtime`` (threads, cores and collectives)."""

    device: Literal["cpu", "cuda"] = "cpu"
    """Compute device (cuda uses NCCL for DDP; the store's collectives stay on gloo)."""
    seed: int = 0
    """Seed of the dense model's initialization."""
    epochs: int = 1
    """Passes over the training split."""
    max_steps: int = 0
    """Stop after this many steps (0: no limit beyond ``epochs``)."""
    log_every: int = 50
    """Write a metrics line every this many steps."""
    record_rows: bool = False
    """Audit exactly-once delivery: every rank appends the ``row_id`` of each step's rows to
    ``RUN_DIR/rows/`` (needs ``row_id`` in ``data.train.passthrough``); ``recsys.train.rows``
    reads them back as the rows the final trajectory consumed, per epoch."""
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    """Progress display on rank 0: a bar on a TTY, plain periodic lines otherwise."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The dense optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The dense learning rate's warm-up and decay."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic evaluations, the best checkpoint and early stopping."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and retention."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Threads, core pinning, priorities, the local exchange and the collectives' timeout."""

    def __post_init__(self) -> None:
        for name in ("epochs", "max_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, found {getattr(self, name)}")
        if self.epochs == 0 and self.max_steps == 0:
            raise ValueError("set epochs or max_steps")
        if self.log_every <= 0:
            raise ValueError(f"log_every must be > 0, found {self.log_every}")
        if self.schedule.decay != "none" and not self.max_steps:
            raise ValueError(f"schedule.decay = {self.schedule.decay!r} ends at optim.lr * schedule.min_lr_ratio "
                             "at the last step: set max_steps (the step count), or schedule.decay = 'none'")


@dataclass(kw_only=True, slots=True)
class PublishConfig:
    """Live pushes of fresh rows to the serving tier while training (off unless ``redis`` is set)."""

    redis: str = ""
    """Redis (or Redis Cluster) URL to push live rows to; empty: no live pushes. A password in
    the URL is used but never saved (``config.toml`` and checkpoints keep the URL without
    it): a resumed run takes it from ``redis_password_file`` or ``$REDIS_PASSWORD``."""
    redis_password_file: str = ""
    """File holding the password of ``redis``, for a URL without one (else ``$REDIS_PASSWORD``)."""
    every_s: float = 5.0
    """Seconds between snapshots of the touched rows (per rank)."""
    namespace: str = "live"
    """Live namespace (``recsys serve --follow NAMESPACE`` overlays it)."""
    dtype: str = "float32"
    """Stored row type: ``float32`` or ``float16`` (half the bytes; served as float32)."""
    max_rows_per_push: int = 1_000_000
    """Most rows one snapshot writes (per rank); the rest stay touched for the next one."""
    buckets: int = 64
    """Hash-slot buckets per table (a Redis Cluster spreads a table over this many slots)."""
    queue_snapshots: int = 2
    """Snapshots waiting for the push thread; when full, pushes coalesce."""
    retries: int = 3
    """Attempts of one snapshot's write before it is dropped (its keys are published later)."""
    backoff_s: float = 0.2
    """First retry delay (doubles per attempt)."""
    timeout_s: float = 5.0
    """Socket timeout of one Redis call."""
    final_timeout_s: float = 60.0
    """How long the end of training waits for the last snapshot to be written."""
    nice: int = 0
    """Raise the push thread's nice value to this (Linux; 0..19), so packing and sending rows
    take less of the CPU the training step wants. Off by default: a higher nice value showed
    no throughput gain within the noise, and a starved push thread pushes later (freshness)."""
    takeover: bool = False
    """Start even when the namespace holds another run's live rows: delete them first (the
    step guard would otherwise refuse this run's rows until its steps passed the old ones)."""

    def __post_init__(self) -> None:
        from recsys.redisio import published as layout  # numpy and numba: not at the job config's import

        if self.redis:
            from recsys.redisio.client import check_url

            check_url(self.redis, "publish.redis")
        layout.check_name(self.namespace, "publish.namespace")
        if self.dtype not in layout.DTYPES:
            raise ValueError(f"publish.dtype must be one of {sorted(layout.DTYPES)}, found {self.dtype!r}")
        if not self.every_s > 0:
            raise ValueError(f"publish.every_s must be > 0, found {self.every_s}")
        for name in ("max_rows_per_push", "buckets", "queue_snapshots", "retries"):
            if getattr(self, name) < 1:
                raise ValueError(f"publish.{name} must be >= 1, found {getattr(self, name)}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"publish.nice must be in 0..19, found {self.nice}")
        for name in ("backoff_s", "timeout_s", "final_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"publish.{name} must be >= 0, found {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return bool(self.redis)


EARLY_STOPPING_DEFAULTS: dict[str, object] = {
    "train.eval.keep_best": "auc",
    "train.eval.validation_fraction": 0.1,
    "train.eval.every_epochs": 1,
    "train.eval.early_stopping_patience": 3,
    "train.epochs": 20,
}
"""What ``recsys tune`` and ``recsys train --early-stopping`` supply when the job does not say
(``early_stopping_defaults``): the objective, a validation split of the training files (seeded
by ``data.train.holdout_seed``), an evaluation every epoch, early stopping and an epoch cap."""


def early_stopping_defaults(data: dict) -> tuple[dict, dict[str, object]]:
    """Return the job ``data`` (plain data, ``--set`` applied) with ``EARLY_STOPPING_DEFAULTS``
    set where the job says nothing, and those it set. What the job or a ``--set`` says wins:
    a validation split when it has none (no ``data.validation.paths``, no held-out fraction),
    an evaluation every epoch when it has no periodic one, the epoch cap when it sets neither
    ``train.epochs`` nor ``train.max_steps``."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    train = out["train"] = dict(out.get("train") or {})
    ev = train["eval"] = dict(train.get("eval") or {})
    data_sec = out.get("data") or {}
    chosen: dict[str, object] = {}

    def supply(section: dict, key: str, full: str) -> None:
        section[key] = chosen[full] = EARLY_STOPPING_DEFAULTS[full]

    if not (ev.get("every") or ev.get("every_epochs")) and "every_epochs" not in ev:
        supply(ev, "every_epochs", "train.eval.every_epochs")
    # a job that turns periodic evaluations off (every_epochs = 0, no every) gets no objective,
    # split or early stopping: what it says wins, and the check of the job names what it lacks
    periodic = bool(ev.get("every") or ev.get("every_epochs"))
    if "keep_best" not in ev and periodic:
        supply(ev, "keep_best", "train.eval.keep_best")
    validation = (data_sec.get("validation") or {}).get("paths")
    holdout = (data_sec.get("train") or {}).get("holdout_fraction")
    if "validation_fraction" not in ev and not validation and not holdout and periodic:
        supply(ev, "validation_fraction", "train.eval.validation_fraction")
    if "early_stopping_patience" not in ev and periodic:
        supply(ev, "early_stopping_patience", "train.eval.early_stopping_patience")
    if "epochs" not in train and "max_steps" not in train:
        supply(train, "epochs", "train.epochs")
    return out, chosen


def describe_defaults(chosen: dict[str, object], by: str) -> str:
    """One line: what ``by`` chose (``early_stopping_defaults``) and how to say otherwise."""
    if not chosen:
        return f"{by}: the job sets its objective, validation split, evaluations, early stopping and epochs"
    shown = ", ".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in chosen.items())
    return f"{by}: the job does not say, so: {shown} (set them in the job or with --set to choose otherwise)"
