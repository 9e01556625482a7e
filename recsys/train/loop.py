"""The training loop: reader → store lookup → model → loss → backward → DDP + sparse push.

One step t on every rank (the store's work runs on its own thread and process group)::

    lookup_t = future.result()                    rows of batch t (seen pushes <= t-s-1)
    batch t+1 read; store.submit_lookup(t+1)      overlaps the rest of step t
    pooled = lookup_t.pooled(); logits = model(dense, pooled); loss.backward()   (DDP all-reduce)
    store.push(lookup_t)                          row gradients to their owners
    dense optimizer step; control all-reduce: [has data, stop asked, checkpoint due]

All ranks run the same number of steps: a rank whose data ran out feeds empty batches
(zero rows: zero gradients) until every rank is done, so collectives always pair up.

Checkpoints flush the store first, so weights and optimizer state are from one step
(no half-applied push). A checkpoint is also a synchronization point of the store: with
``staleness = s > 0`` the look-ahead lookup (which read its rows without the last ``s``
pushes) is withdrawn and redone after the save, seeing every push, exactly as the first
lookup of a run resumed from that checkpoint does. Its key work (touch, insert, evict)
is done twice in both runs alike and its admission sightings count once in both (the
store counts a redone step's sightings once), so a resumed run equals the uninterrupted
one at every staleness (tests/test_train.py, tests/test_admission_resume.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from recsys import config as config_mod
from recsys.runtime import priority
from recsys.io.batch import Batch, empty_batch
from recsys.io.reader import ParquetReader
from recsys.runtime.local_exchange import LocalExchange
from recsys.model.arch import model_for, model_inputs
from recsys.model.heads import per_head
from recsys.store.sharded.store import ShardedEmbeddingStore
from recsys.store.tables.wide import table_names
from recsys.checkpoint import write as ckpt
from recsys.train.distributed import EXCHANGE_MAX_RANKS, exchange_mean, init_distributed, local_mean, new_group
from recsys.train.metrics import MetricsLog, Progress, evaluate_predictions
from recsys.train.rows import ROWS_DIR, RowRecorder, attempt_name
from recsys.runtime.transfer import Transfers, arrive


@dataclasses.dataclass
class Env:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    collective_timeout_s: float = 300.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_env(device: str, collective_timeout_s: float = 300.0) -> Env:
    """Return the process's place in the job, initializing torch.distributed under torchrun.

    The default group's keys live in a namespace of this launch attempt and every
    collective times out after ``collective_timeout_s`` (``recsys.train.distributed``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device == "cuda":
        from recsys.errors import UserError

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= visible:
            raise UserError(f"train.device = 'cuda': local rank {local_rank} needs GPU {local_rank}, "
                            f"{visible} visible (one process per GPU)")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    # torch's notice about its own API ("is_fx_tracing will return true...", reached through
    # torchrec), printed by every process: nothing a user can act on
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    if world > 1 and not dist.is_initialized():
        # on GPUs: NCCL for CUDA tensors (DDP's all-reduce), gloo for the host tensors of the
        # trainer's control collectives and object gathers; the store has a gloo group of its own
        init_distributed("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", collective_timeout_s)
    return Env(rank, world, local_world, dev, collective_timeout_s)


# No buffer broadcast before every forward (a collective a step, 4 % of a rank's main thread):
# the models' buffers are index constants built alike on every rank (tests/test_model.py
# checks that training leaves them unchanged). torch 2.13 names the switch
# ``forward_sync_buffers`` and warns about ``broadcast_buffers``; older ones know only that.
_NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                           if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                           else {"broadcast_buffers": False})


def _all_max(values: list[int], env: Env, local: LocalExchange | None = None) -> list[int]:
    if env.world_size == 1:
        return values
    if local is not None:
        return np.maximum.reduce(local.all_gather(np.array(values, dtype=np.int64))).tolist()
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``n`` torch intra-op threads (0: unchanged), then restore the count."""
    before = torch.get_num_threads()
    if not n or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _loss(logits: torch.Tensor, batch) -> torch.Tensor:
    return bce(logits, batch.labels, batch.weights)


def bce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy of a batch: the mean over rows, or with sample weights
    (``schema.weight``) the mean of w·l over rows, Σ w·l / B (as torch's ``weight`` and
    Keras's ``sample_weight`` do). Not Σ w·l / Σ w: each rank's loss is averaged by DDP, and
    only a per-row normalization makes that average the global batch's, so 2 ranks equal 1.
    With ``model.heads`` K > 1 (``logits`` [B, K]): the mean of the K heads' losses. The
    training loop's loss, and the benches' (``recsys.bench.train``, ``train_gpu``)."""
    labels = per_head(labels, logits)
    if weights is None:
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, weight=per_head(weights, logits))


def lr_lambda(cfg, total_steps: int | None):
    """Return the LR multiplier function: linear warm-up, then none/linear/cosine decay."""

    def f(step: int) -> float:
        k = step + 1  # LambdaLR's step counts from 0 at construction: the LR of training step k (1-based)
        if cfg.warmup_steps and k <= cfg.warmup_steps:
            return k / cfg.warmup_steps
        if cfg.decay == "none" or not total_steps or total_steps <= cfg.warmup_steps:
            return 1.0
        # from lr after the warm-up down to lr * min_lr_ratio at the last step
        frac = min(1.0, (k - cfg.warmup_steps) / (total_steps - cfg.warmup_steps))
        floor = cfg.min_lr_ratio
        if cfg.decay == "linear":
            return 1.0 - (1.0 - floor) * frac
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return f


def read_splits(job):
    """Return the reader settings of the training split and of the validation split (None:
    the job has none; periodic evaluations then read the eval split).

    With ``train.eval.validation_fraction`` both read the training files: training all row groups
    but the held-out ones, validation only them (``data.train.holdout_seed`` and ``holdout_fold``
    choose which), with ``data.validation``'s read settings."""
    from recsys.config import ConfigError

    data, fraction = job.data, job.train.eval.validation_fraction
    if not fraction:
        return data.train, (data.validation if data.validation.paths else None)
    if data.validation.paths:
        raise ConfigError("train.eval.validation_fraction carves the validation split out of the training files: "
                          "remove data.validation.paths, or set train.eval.validation_fraction = 0")
    if data.train.holdout_fraction:
        raise ConfigError("set train.eval.validation_fraction or data.train.holdout_fraction, not both")
    held = dict(holdout_fraction=fraction, holdout_seed=data.train.holdout_seed, holdout_fold=data.train.holdout_fold)
    validation = dataclasses.replace(data.validation, paths=list(data.train.paths), on_bad_file=data.train.on_bad_file,
                                     holdout="only", **held)
    return dataclasses.replace(data.train, holdout="exclude", **held), validation


def record_validation_split(cfg, schema, run_dir: Path) -> None:
    """Write ``RUN_DIR/validation.json``: the row groups held out for validation."""
    import json

    from recsys.io.units import build_units, expand_paths, hold_out

    table, _ = hold_out(build_units(expand_paths(cfg.paths), schema, list(cfg.passthrough), cfg.on_bad_file),
                        cfg.holdout_fraction, cfg.holdout_seed, "only", cfg.holdout_fold)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "validation.json").write_text(json.dumps({
        "fraction": cfg.holdout_fraction, "seed": cfg.holdout_seed, "fold": cfg.holdout_fold, "paths": list(cfg.paths),
        "rows": int(table.unit_rows.sum()), "row_groups": table.unit_keys}, indent=1) + "\n")


class Trainer:
    """Builds the components of a job and runs its training loop."""

    def __init__(self, job, run_dir: Path, env: Env, resume: str | None = None, source=None) -> None:
        """``source`` replaces the training reader (anything with the reader's interface).

        The phases, in order (each a method): the job's checks, the process's cores and
        threads, the model (with DDP and the dense optimizer), the stores, the reader, the
        loop's state, the restore of a checkpoint, and live publishing."""
        self.job, self.run_dir, self.env = job, Path(run_dir), env
        self._check_job()  # config errors before any thread starts
        self._place_process()
        self._build_model()
        self.ckpt_root = self.run_dir / "checkpoints"
        restore_from = resume or ckpt.latest(self.ckpt_root)  # restored below, before any other store call
        self.store = self._build_stores(restoring=restore_from is not None)
        self._build_reader(resume, source)
        self._init_loop_state()
        if restore_from is not None:
            self.restore(ckpt.resolve(restore_from))
        self.rows = self._row_recorder() if job.train.record_rows else None
        if job.publish.enabled:
            try:
                self._start_publishing()
            except BaseException:
                self.close()  # a refused namespace: nothing left open
                raise

    def _check_job(self) -> None:
        """Refuse what the job cannot train; resolve the training and validation splits."""
        job = self.job
        if job.train.record_rows and "row_id" not in job.data.train.passthrough:
            from recsys.config import ConfigError

            raise ConfigError("train.record_rows needs the column row_id in data.train.passthrough, "
                              f"found passthrough = {list(job.data.train.passthrough)}")
        from recsys.store.sharded.device_keys import refusal

        why = refusal(job.schema, job.store, self.env.world_size, publish=job.publish.enabled)
        if why is not None:
            from recsys.config import ConfigError

            raise ConfigError(why)
        self.train_cfg, self.validation_cfg = read_splits(job)

    def _place_process(self) -> None:
        """This process's cores (``train.runtime.pin_cores``) and torch's intra-op threads."""
        tc, env = self.job.train, self.env
        self.cores = None
        """The cores this process is pinned to (``train.runtime.pin_cores``; None: not pinned)."""
        if tc.runtime.pin_cores and env.device.type == "cpu":
            from recsys.train.cores import pin_process

            self.cores = pin_process(int(os.environ.get("LOCAL_RANK", "0")), env.local_world_size)
        torch.set_num_threads(tc.runtime.threads or max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))

    def _build_model(self) -> None:
        """The dense model on the device, DDP over it (with the host's gradient exchange),
        the dense optimizer and its learning-rate schedule."""
        job, tc, env = self.job, self.job.train, self.env
        torch.manual_seed(tc.seed)
        self.model = model_for(job).to(env.device)
        self._transfers = Transfers(env.device)  # a batch's dense side, host → device (recsys.runtime.transfer)
        self.ddp = (
            DistributedDataParallel(self.model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                                    **_NO_FORWARD_BUFFER_SYNC)
            if env.world_size > 1
            else self.model
        )
        # the main thread's collectives among ranks of one host (CPU): through shared memory
        self._local = (LocalExchange.open(dist.group.WORLD, env.collective_timeout_s)
                       if env.world_size > 1 and env.device.type == "cpu" and tc.runtime.local_exchange else None)
        if env.world_size > 1 and env.device.type == "cpu" and env.world_size <= EXCHANGE_MAX_RANKS:
            if self._local is not None:
                self.ddp.register_comm_hook(self._local, local_mean)
            else:
                self.ddp.register_comm_hook(self.ddp.process_group, exchange_mean)
        opt_cls = torch.optim.Adam if tc.optim.name == "adam" else torch.optim.Adagrad
        impl = {"fused": True} if tc.optim.fused else {"foreach": True}
        self.opt = opt_cls(self.model.parameters(), lr=tc.optim.lr, weight_decay=tc.optim.weight_decay, **impl)
        self.total_steps = tc.max_steps or None
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(tc.schedule, self.total_steps))

    def _build_stores(self, restoring: bool):
        """Return the job's embedding store (with ``model.wide``, paired with the wide arm's
        store); ``restoring``: a checkpoint is loaded before any other store call."""
        job, tc, env = self.job, self.job.train, self.env

        def sharded(schema, cfg) -> ShardedEmbeddingStore:
            # the store's collectives run on its own thread: a group of their own, same timeout
            group = new_group(env.collective_timeout_s) if dist.is_initialized() else None
            return ShardedEmbeddingStore(schema, cfg, group=group, device=env.device, threaded=True,
                                         run_dir=self.run_dir, job_name=job.name, restoring=restoring,
                                         local_exchange=tc.runtime.local_exchange,
                                         collective_timeout_s=env.collective_timeout_s)

        store = sharded(job.schema, job.store)
        if job.model.wide:  # the wide arm's dim-1 tables: a store of their own (recsys.store.tables.wide)
            from recsys.store.tables import wide

            store = wide.WideStore(store, sharded(wide.wide_schema(job.schema), wide.wide_store_config(job.store,
                                                                                                       job.model)))
        return store

    def _build_reader(self, resume: str | None, source) -> None:
        """The dense columns' statistics, the training reader (``source`` if given) and the
        record of the validation split's row groups."""
        tc, env = self.job.train, self.env
        self.dense_stats = self._dense_stats(resume)
        self.reader = source or ParquetReader(self.train_cfg, self.job.schema, rank=env.rank,
                                              world_size=env.world_size, dense_stats=self.dense_stats)
        if tc.eval.validation_fraction and env.is_main:
            record_validation_split(self.validation_cfg, self.job.schema, self.run_dir)

    def _init_loop_state(self) -> None:
        """The training loop's counters, log, best evaluation and early-stopping state."""
        self.step = 0
        self.epoch = 0
        """The epoch every rank is training (a rank whose data ran out feeds empty batches)."""
        self.log = MetricsLog(self.run_dir, enabled=self.env.is_main)
        self._stop = False
        self.best: dict | None = None
        """The best periodic evaluation so far: {"metric", "value", "step"} (keep_best / early stopping)."""
        self.evals_without_improvement = 0
        self.after_validation = None
        """Called on every rank after each periodic evaluation as ``hook(step, result)`` (``recsys
        tune`` reports it to its pruner); a true return (the same on every rank) stops the run as
        early stopping does, with ``"stopped": "pruned"``."""
        self.pruned = False
        self._empty = empty_batch(self.job.schema, list(self.job.data.train.passthrough))
        self._state_before_fetch: dict | None = None

    def _start_publishing(self) -> None:
        """Live pushes (``[publish]``; ``recsys.train.live_push``): rank 0 claims the live
        namespace, then every rank publishes the rows its shard owns (with ``model.wide``, of
        both stores: the embeddings and the wide arm's weights)."""
        from recsys.store.config import run_namespace
        from recsys.train.live_push import LivePublisher, PublisherGroup, claim, live_manifest

        from recsys.train.distributed import attempt_token

        cfg = self.job.publish
        wide = self.job.model.wide
        if self.env.is_main:
            claim(cfg, live_manifest(cfg, run_namespace(self.run_dir, self.job.name), self.job.schema, wide))
        rank, group = self.env.rank, attempt_token(self.env.world_size)
        make = lambda read_rows: LivePublisher(cfg, rank, read_rows, group=group)  # noqa: E731
        if wide:  # the wide arm's weights from its own store: a second writer of this attempt's group
            self.store.attach_publisher(make, lambda read_rows: LivePublisher(
                cfg, rank, read_rows, group=group, member=f"{rank}.wide"), PublisherGroup)
        else:
            self.store.attach_publisher(make)
        if self.env.world_size > 1:  # every rank's writers are registered before any rank writes
            dist.barrier()

    def _finish_publishing(self) -> None:
        """Write the last live rows (every rank), then log what the pushes did over all ranks."""
        publisher = self.store.publisher
        if publisher is None:
            return
        self.store.flush(through_step=self.step - 1)  # every trained step (not a look-ahead)
        written = self.store.finish_publisher(self.step)
        counters = publisher.totals()
        names = sorted(counters)
        totals = [float(counters[n]) for n in names] + [0.0 if written else 1.0]
        if self.env.world_size > 1:
            t = torch.tensor(totals, dtype=torch.float64)
            dist.all_reduce(t)
            totals = t.tolist()
        self.log.event("publish", step=self.step, **{n: int(v) for n, v in zip(names, totals)},
                       ranks_unfinished=int(totals[-1]))

    def _dense_stats(self, resume: str | None):
        """Return the dense statistics the job's transforms read (None if none does): the
        checkpoint's when resuming, else one pass over the training split, shared by the
        ranks (``recsys.io.dense_stats``); rank 0 writes them to ``RUN_DIR/dense_stats.json``."""
        if not self.job.schema.needs_dense_stats:
            return None
        import json

        from recsys.features.dense import DenseStats
        from recsys.io import dense_stats

        source = resume or ckpt.latest(self.run_dir / "checkpoints")
        if source is not None:
            path = ckpt.resolve(source)
            saved = ckpt.load_meta(path).get("dense_stats")
            if saved is not None:
                return DenseStats.from_json(saved, f"{path}/meta.json:dense_stats")
        env = self.env

        def gather(mine: list) -> list[list]:
            parts = [None] * env.world_size
            dist.all_gather_object(parts, mine)
            return parts

        stats = dense_stats.compute(self.train_cfg, self.job.schema, env.rank, env.world_size,
                                    gather if env.world_size > 1 else None)
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.run_dir / "dense_stats.json.tmp"
            tmp.write_text(json.dumps(stats.to_json(), indent=1) + "\n")
            os.replace(tmp, self.run_dir / "dense_stats.json")
        return stats

    def _row_recorder(self) -> RowRecorder:
        """Start this attempt's row audit (``train.record_rows``; see ``recsys.train.rows``)."""
        name = [attempt_name(self.run_dir / ROWS_DIR, self.step) if self.env.is_main else None]
        if self.env.world_size > 1:
            dist.broadcast_object_list(name, src=0)
        return RowRecorder(self.run_dir, name[0], self.env.rank)

    # ------------------------------------------------------------------ checkpoints

    def save(self, lookahead: bool) -> Path:
        """Write a checkpoint of this step (collective).

        ``lookahead``: the next batch was already taken from the reader (for the lookup
        overlap), so the reader state saved is the one from before that fetch.
        """
        self.store.flush(through_step=self.step - 1)
        reader_state = self._state_before_fetch if lookahead else self.reader.state_dict()
        states = [reader_state]
        if self.env.world_size > 1:
            states = [None] * self.env.world_size
            dist.all_gather_object(states, reader_state)
        dense = {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        meta = {"reader": type(self.reader).merge_states(states), "epoch": self.epoch,
                "config": config_mod.dumps(self.job), "best": self.best,
                "evals_without_improvement": self.evals_without_improvement}
        if self.dense_stats is not None:  # eval and serving transform exactly as training did
            meta["dense_stats"] = self.dense_stats.to_json()
        path = ckpt.save(self.ckpt_root, self.step, sparse=self.store.write_state,
                         dense={**dense, **self.store.admission_state_dict()},
                         meta=meta, keep_last=self.job.train.checkpoint.keep_last)
        self.log.event("checkpoint", step=self.step, path=str(path))
        return path

    def restore(self, path: Path) -> None:
        """Load a checkpoint saved at any world size."""
        meta = ckpt.load_meta(path)
        dense = ckpt.load_dense(path)
        self.model.load_state_dict(dense["model"])
        self.opt.load_state_dict(dense["optimizer"])
        self.sched.load_state_dict(dense["scheduler"])
        torch.set_rng_state(dense["torch_rng"])
        self.store.load_state_dict(ckpt.load_sparse(path, table_names(self.job.schema, self.job.model.wide)),
                                   admission=dense.get("admission"))
        self.reader.load_state_dict(meta["reader"])
        self.step = int(meta["step"])
        # checkpoints before the trainer saved its epoch: the reader's (exact unless a rank
        # had already delivered its whole share of that epoch)
        self.epoch = int(meta.get("epoch", self.reader.epoch))
        self.best = meta.get("best")
        self.evals_without_improvement = int(meta.get("evals_without_improvement", 0))
        self.log.event("resumed", step=self.step, path=str(path), saved_world_size=meta["world_size"])

    # ------------------------------------------------------------------ the loop

    def _epoch_batches(self, epoch: int):
        """Return this rank's batches of ``epoch`` (all ranks train one epoch at a time).

        A rank whose share of the epoch was all delivered before the checkpoint this run
        resumed from has none left: it feeds empty batches until every rank is done, as it
        did in the uninterrupted run, instead of letting its reader roll into the next epoch.
        """
        # a replacement source without ``next_epoch`` never reports a share delivered ahead
        ahead = getattr(self.reader, "next_epoch", self.reader.epoch)
        if ahead == epoch:
            return iter(self.reader)
        if ahead == epoch + 1:
            return iter(())
        raise RuntimeError(f"rank {self.env.rank}: the reader is at epoch {ahead}, the job at epoch {epoch}")

    def _fetch(self, it) -> Batch | None:
        self._state_before_fetch = self.reader.state_dict()
        return next(it, None)

    def _submit(self, batch: Batch | None, step: int):
        return self.store.submit_lookup((batch or self._empty).sparse, step)

    def _stage(self, batch: Batch | None):
        """Start the copy of ``batch``'s dense side to the device (on a GPU: from pinned memory
        on a side stream, overlapping the current step); ``_arrive`` returns the moved batch."""
        batch = batch or self._empty
        if self._transfers.stream is None:
            return batch.to(self.env.device), None
        fields = [batch.dense, batch.labels, batch.weights, *batch.extra.values()]
        moved, event = self._transfers.to_device([t for t in fields if t is not None])
        weights = None if batch.weights is None else moved.pop(2)
        extra = dict(zip(batch.extra, moved[2:]))
        return Batch(dense=moved[0], labels=moved[1], sparse=batch.sparse, extra=extra, weights=weights), event

    def _arrive(self, staged) -> Batch:
        """Return the staged batch on the device, once the compute stream may read it."""
        batch, event = staged
        if event is not None:  # on the CPU nothing was copied: no list built every step
            arrive([batch.dense, batch.labels, batch.weights, *batch.extra.values()], event)
        return batch

    def train(self) -> dict:
        """Run until ``epochs`` or ``max_steps``; return the final metrics."""
        tc, env = self.job.train, self.env
        F = len(self.job.schema.sparse)
        previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        priority.enable(tc.runtime.idle_background and env.device.type == "cpu")
        last_ckpt = time.monotonic()
        progress = Progress(tc.progress, enabled=env.is_main, total=self.total_steps, every=tc.log_every)
        try:
            while not self._done() and self.epoch < tc.epochs and not self._early_stop():
                epoch = self.epoch
                it = self._epoch_batches(epoch)
                nxt = self._fetch(it)
                future = self._submit(nxt, self.step)
                staged = self._stage(nxt)
                while True:
                    t0 = time.perf_counter()
                    has_data, stop, due = _all_max(
                        [nxt is not None, self._stop, self._checkpoint_due(last_ckpt)], env, self._local)
                    if not has_data:  # every rank finished the epoch
                        self.store.cancel(future.result())
                        self._log_epoch_end(epoch)
                        self.epoch += 1
                        if tc.eval.every_epochs and self.epoch % tc.eval.every_epochs == 0:
                            self.store.flush()
                            self._validate(lookahead=False)
                        break
                    lookup = future.result()
                    t1 = time.perf_counter()
                    host = nxt or self._empty
                    cur = self._arrive(staged)
                    final_step = self.total_steps is not None and self.step + 1 >= self.total_steps
                    future = None
                    if not final_step:  # the next lookup and copy overlap this step's compute
                        nxt = self._fetch(it)
                        future = self._submit(nxt, self.step + 1)
                        staged = self._stage(nxt)
                    t2 = time.perf_counter()
                    priority.dense_phase()  # nothing waits for the store or the reader until the push
                    logits = self.ddp(cur.dense, *model_inputs(lookup, F))
                    if cur.size:
                        loss = _loss(logits, cur)
                    else:  # an empty batch still joins DDP's all-reduce, with zero gradients
                        loss = logits.sum() * 0.0
                    self.opt.zero_grad(set_to_none=False)
                    loss.backward()
                    t3 = time.perf_counter()
                    self.store.push(lookup)
                    if tc.optim.clip_grad_norm:
                        torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.optim.clip_grad_norm)
                    lr = self.opt.param_groups[0]["lr"]  # the LR this step trains with
                    with torch_threads(tc.runtime.optimizer_threads):
                        self.opt.step()
                    self.sched.step()
                    self.step += 1
                    if self.rows is not None:
                        self.rows.record(epoch, self.step, host.extra["row_id"].numpy())
                    t4 = time.perf_counter()
                    # on a GPU the loss stays there: read once per logged window, not every step
                    loss_value = loss.item() if env.device.type == "cpu" else loss.detach().double()
                    self.log.step(
                        self.step, epoch, loss_value, cur.size, env.world_size,
                        {"sparse_lookup_wait": t1 - t0, "data_wait": t2 - t1, "dense_fwd_bwd": t3 - t2,
                         "push_and_optimizer": t4 - t3},
                        self.store, lr, log_every=tc.log_every,
                    )
                    progress.update(self.step, self.log.last_loss, self.log.samples_per_s)
                    if tc.eval.every and self.step % tc.eval.every == 0:
                        self._validate(lookahead=future is not None)
                    every = tc.checkpoint.every_steps and self.step % tc.checkpoint.every_steps == 0
                    if stop or due or every:
                        resync = future is not None and self.store.staleness > 0
                        if resync:
                            # a checkpoint is a synchronization point of the store: the
                            # look-ahead lookup read rows without the last pushes (s > 0), a
                            # resumed run cannot; it is redone after the save, seeing them all,
                            # as a run resumed from this checkpoint does (exact at every s)
                            self.store.cancel(future.result())
                        self.save(lookahead=future is not None)
                        if resync:
                            future = self._submit(nxt, self.step)
                        last_ckpt = time.monotonic()
                        if stop:
                            self._finish_publishing()
                            return {"step": self.step, "stopped": "SIGTERM"}
                    if final_step or self._early_stop():
                        if future is not None:
                            self.store.cancel(future.result())
                        break
            self.store.flush()
            self._finish_publishing()
            final = self.evaluate(max_rows=0)
            self.save(lookahead=False)
            out = {"step": self.step, "epoch": self.epoch, **final}
            if self.best is not None:
                out["best"] = self.best
            if self._early_stop():
                out["stopped"] = "pruned" if self.pruned else "early stopping"
            return out
        finally:
            priority.enable(False)
            progress.close()
            signal.signal(signal.SIGTERM, previous_handler)

    def _log_epoch_end(self, epoch: int) -> None:
        """Write the ``epoch_end`` event: what the reader skipped or read past (docs/data.md),
        over all ranks (files are listed by every rank alike; row groups are dealt), counted
        since this process started (a resumed run counts again from 0)."""
        stats = getattr(self.reader, "stats", None)
        if stats is None:
            return
        summed = ("skipped_row_groups", "skipped_rows", "dropped_rows")
        shared = ("skipped_files", "empty_files", "empty_row_groups")
        added = [int(stats.get(k, 0)) for k in summed]
        same = _all_max([int(stats.get(k, 0)) for k in shared], self.env)
        if self.env.world_size > 1:
            t = torch.tensor(added, dtype=torch.int64)
            dist.all_reduce(t)
            added = t.tolist()
        values = added + same
        self.log.event("epoch_end", step=self.step, epoch=epoch, **dict(zip(summed + shared, values)))

    def _validate(self, lookahead: bool) -> dict:
        """Run a periodic evaluation; track the best one, keep its checkpoint, count patience."""
        tc = self.job.train
        result = self.evaluate(max_rows=tc.eval.max_rows, split="validation")
        if self.after_validation is not None and self.after_validation(self.step, result):
            self.pruned = True
        metric = tc.eval.keep_best or ("auc" if tc.eval.early_stopping_patience else "")
        if not metric or metric not in result:
            return result
        value = float(result[metric])
        better = self.best is None or (value > self.best["value"] if metric == "auc" else value < self.best["value"])
        if better:
            self.best = {"metric": metric, "value": value, "step": self.step}
            self.evals_without_improvement = 0
            if tc.eval.keep_best:
                path = self.save(lookahead=lookahead)
                if self.env.is_main:
                    ckpt.set_pointer(self.ckpt_root, "best", path.name)
                self.log.event("best", step=self.step, metric=metric, value=value, path=str(path))
        else:
            self.evals_without_improvement += 1
        return result

    def _early_stop(self) -> bool:
        patience = self.job.train.eval.early_stopping_patience
        return self.pruned or (bool(patience) and self.evals_without_improvement >= patience)

    def _done(self) -> bool:
        return bool(self.total_steps) and self.step >= self.total_steps

    def _checkpoint_due(self, since: float) -> bool:
        minutes = self.job.train.checkpoint.every_minutes
        return bool(minutes) and (time.monotonic() - since) >= 60 * minutes

    def _on_sigterm(self, signum, frame) -> None:
        self._stop = True

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, max_rows: int = 0, split: str = "eval") -> dict:
        """Return AUC / log loss on the eval split, or with ``split="validation"`` on the
        validation split when the job has one (all ranks take part; rank 0 reports)."""
        env, schema = self.env, self.job.schema
        if split == "validation" and self.validation_cfg is None:
            split = "eval"
        cfg = self.validation_cfg if split == "validation" else self.job.data.eval
        if not cfg.paths:
            return {}
        # an evaluation waits for the store and its reader throughout (recsys.runtime.priority)
        priority.raise_all()
        reader = ParquetReader(cfg, schema, rank=env.rank, world_size=env.world_size, dense_stats=self.dense_stats)
        self.model.eval()
        labels, preds, weights = [], [], []
        seen = 0
        it = iter(reader)
        try:
            while True:
                batch = next(it, None)
                if max_rows and seen >= max_rows:
                    batch = None
                (has_data,) = _all_max([batch is not None], env)
                if not has_data:
                    break
                host = batch or empty_batch(schema, list(cfg.passthrough))
                cur = host.to(env.device)  # the dense side; ids, labels and weights are read on the host
                lookup = self.store.lookup(host.sparse, None, train=False)
                logits = self.model(cur.dense, *model_inputs(lookup, len(schema.sparse)))
                labels.append(host.labels.numpy())
                preds.append(torch.sigmoid(logits).cpu().numpy())
                if host.weights is not None:
                    weights.append(host.weights.numpy())
                seen += cur.size * env.world_size
        finally:
            reader.close()
            self.model.train()
        y = np.concatenate(labels) if labels else np.empty(0)
        p = np.concatenate(preds) if preds else np.empty(0)
        w = (np.concatenate(weights) if weights else np.empty(0)) if schema.weight else None
        if env.world_size > 1:
            gathered = [None] * env.world_size
            dist.all_gather_object(gathered, (y, p, w))
            y = np.concatenate([g[0] for g in gathered])
            p = np.concatenate([g[1] for g in gathered])
            w = np.concatenate([g[2] for g in gathered]) if schema.weight else None
        result = evaluate_predictions(y, p, w)
        self.log.event("eval", step=self.step, split=split, **result)
        return result

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
        if self.store.publisher is not None:
            self.store.publisher.close()
        self.store.close()
        if self._local is not None:
            self._local.close()
        self.reader.close()
        self.log.close()
