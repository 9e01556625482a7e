"""``recsys bench train``: our trainer against torchrec's and against the dense model alone.

One run, one data set, one model (``RankingModel``, the job's DLRM and dims), one batch
size ``B``, 2 torch threads in one process:

(a) **ours**: ``Trainer`` on ``jobs/synthetic_small.toml``: our reader (Parquet decode and
    hashing, on its background thread), the store (lookup, push, row-wise Adagrad, on its
    worker thread), pooling, dense forward/backward, Adam. Nothing skipped.
(b) **the peer**: torchrec ``DistributedModelParallel`` over a one-process gloo group on
    CPU: an ``EmbeddingBagCollection`` with one table per schema table, sharded by the
    planner (table-wise, ``fused`` kernel: fbgemm's CPU TBE) with the sparse optimizer
    fused into the backward (``EXACT_ROWWISE_ADAGRAD``, the store's lr and eps), the same
    ``RankingModel`` on the pooled output viewed as ``[B, F, D]``, trained by torchrec's
    ``TrainPipelineSparseDist`` (it runs on CPU: no streams, the input dist of the next
    batch is still issued ahead; the JSON lists the modules it pipelined). Tables are
    pre-sized to the row budget ours gets (a table's ``num_rows`` if set, else its
    ``capacity``; ours holds at most that many rows) and start like ours, U(-a, a) with
    the store's bound ``a``. Its batches come from the same files through our reader
    (same seed: the same batches in the same order as (a)), the hashed keys folded to
    their table's rows with one ``torch.remainder`` per batch, inside the timed loop:
    reading and hashing cost both sides alike, folding is the peer's own input step.
    Same dense optimizer (Adam, the job's lr, the same warm-up schedule; torch's ``foreach``
    implementation on every side, as the trainer runs it).
(c) **the limit**: the same ``RankingModel``'s forward, backward and Adam step on a few
    pre-made in-memory batches: random dense ``[B, N]`` and pooled ``[B, F, D]`` given as
    inputs (no gradient wanted for them). No reading, no embedding work at all.

Timing alternates, so a noisy neighbour hurts every side alike: (a) runs its real
``train()``, its batches handed over by a wrapper of our reader which, every ``chunk``
steps, runs one segment of (b) and one of (c) (their order swapped each time) before
passing the batch on. (a) is paused only inside its batch fetch, when its store and
reader threads are idle (the lookup of that batch is not yet submitted). Samples/s =
rows of the timed steps / their seconds, after ``warmup_chunks × chunk`` untimed steps;
(a)'s steps are timed fetch to fetch (one step each), pauses excluded. The headline ratio
is total rows / total seconds per side; for a vs b and a vs c the table adds the median
and min-max of the ratios of each pair of segments run back to back (``paired_ratios``
in the JSON), which show how noisy the machine was.

2 processes vs 1: ``recsys train --nproc 2`` (torchrun, gloo, 1 torch thread each,
per-rank batch B/2, so the same global batches and total samples) against ``recsys train
--nproc 1`` (1 process, 2 threads, batch B), both as a user runs them and measured alike:
from their ``metrics.jsonl`` windows after the same warm-up, without evaluation. The two
alternate, ``scaling_rounds`` rounds each (the order swapped every round), after the
alternating part above; the table gives the median and min-max of the rounds' ratios.

AUC: (a)'s final evaluation and (b)'s, on the whole eval split, after the same N steps
of the same batches.

Full: the ``small`` synthetic set (1.8 M rows; generated if missing), B = 4096, 421
steps (96 % of an epoch: as many as each of 2 ranks surely has data for, since units are
dealt by rows and ranks differ by at most one row group). ``--quick``: a 160 k-row set of
the same shape (``bench-out/data/train-quick``), 31 steps, no dense LR warm-up (for both:
the job's 100 steps would leave its AUCs at chance). No assertions on timings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from recsys.bench import comparison, paired_ratio, with_passive_omp, quiet_fbgemm, versions
from recsys.bench.reader import ensure_data as ensure_small_data
from recsys.errors import UserError
from recsys.runtime.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "synthetic_small.toml"
QUICK_DATA = ROOT / "bench-out" / "data" / "train-quick"

# Legend: B batch rows, N dense columns, F sparse features, D embedding dim.


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sizes of one benchmark run (``FULL``, ``QUICK``; tests pass tiny ones)."""

    batch_size: int = 4096
    chunk: int = 21
    """Steps per alternation segment (and per metrics window of the trainer)."""
    warmup_chunks: int = 2
    """Untimed segments first (startup, JIT, first inserts, the peer's pipeline fill)."""
    timed_chunks: int = 18
    """Timed segments per side (their paired ratios give the median and spread)."""
    threads: int = 2
    """Torch threads of the one-process runs (the two processes get 1 each)."""
    dense_batches: int = 4
    """Pre-made batches the limit cycles through."""
    scaling: bool = True
    """Also run ours with 2 processes (torchrun) against 1, as ``recsys train`` runs."""
    scaling_rounds: int = 3
    """Rounds of (1 process, 2 processes), the order swapped every round."""
    scaling_timeout_s: float = 1800.0
    job: str = str(JOB)
    """Job whose schema, model and optimizers every side uses."""
    lr_warmup_steps: int | None = None
    """Dense LR warm-up of (a) and (b) (None: the job's; a short run cannot sit in a long one)."""

    @property
    def warmup_steps(self) -> int:
        return self.chunk * self.warmup_chunks

    @property
    def steps(self) -> int:
        """Training steps of (a) and (b): warm-up, the timed segments, and the step after
        the last pause point (a's last batch is fetched one step before the end)."""
        return self.warmup_steps + self.chunk * self.timed_chunks + 1

    @property
    def timed_steps(self) -> int:
        return self.chunk * self.timed_chunks


FULL = Settings()
QUICK = Settings(chunk=5, timed_chunks=4, lr_warmup_steps=0, scaling_rounds=1)
"""31 steps: each of 2 ranks surely has data for 35 of the quick set (``steps_each_rank_surely_has``)."""


def _quick_preset():
    from recsys.io.synth import Preset

    return Preset(name="bench-train-quick", train_rows=160_000, eval_rows=20_000,
                  rows_per_file=65_536, row_group_size=16_384)


def ensure_data(quick: bool, data: Path | None, quick_dir: Path | None = None, quick_preset=None) -> Path:
    """Return the data directory of the run, generating the default one when missing
    (``--quick``: ``quick_dir`` from ``quick_preset``, by default this bench's)."""
    if data is not None or not quick:
        return ensure_small_data(False, data)
    from recsys.io import synth

    quick_dir = quick_dir or QUICK_DATA
    if not (quick_dir / "oracle.json").exists():
        print(f"generating {quick_dir} ...", flush=True)
        synth.generate(quick_preset or _quick_preset(), quick_dir)
    return quick_dir


def load_bench_job(root: Path, s: Settings, *extra: str):
    """Return the job every side trains: the settings' job on ``root``'s splits."""
    from recsys.config import load_job

    return load_job(s.job, [
        f"data.train.paths=['{root / 'train'}']",
        f"data.eval.paths=['{root / 'eval'}']",
        f"data.train.batch_size={s.batch_size}",
        "train.epochs=1",
        f"train.max_steps={s.steps}",
        f"train.runtime.threads={s.threads}",
        f"train.log_every={s.chunk}",
        "train.eval.every=0",
        "train.checkpoint.every_steps=0",
        "train.checkpoint.every_minutes=0.0",
        "train.progress='none'",
        *([] if s.lr_warmup_steps is None else [f"train.schedule.warmup_steps={s.lr_warmup_steps}"]),
        *extra,
    ])


@contextlib.contextmanager
def _silent():
    """Silence torchrec's setup notices too (planner and tracing warnings about GPU-era
    defaults that do not apply to a one-process CPU run), on top of fbgemm's."""
    import logging

    with quiet_fbgemm():
        before = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(before)


def job_settings(job) -> dict:
    """Return what a training bench's JSON says of its job: model, sizes, optimizers, threads."""
    import torch

    return {
        "model": dataclasses.asdict(job.model),
        "features": len(job.schema.sparse),
        "dense_columns": len(job.schema.dense),
        "dim": next(iter(job.schema.tables.values())).dim,
        "sparse_optimizer": {"name": job.store.optimizer, "lr": job.store.lr, "eps": job.store.eps},
        "dense_optimizer": {"name": job.train.optim.name, "lr": job.train.optim.lr,
                            "warmup_steps": job.train.schedule.warmup_steps, "decay": job.train.schedule.decay},
        "torch_threads": torch.get_num_threads(),
    }


def _table_rows(spec) -> int:
    """Return the peer's pre-sized rows of a table: the row budget our store gets."""
    return spec.num_rows if spec.num_rows is not None else spec.capacity


# --------------------------------------------------------------------------- (a) ours


class PausingSource:
    """Our reader for the trainer, running ``on_pause(i)`` before handing over batch ``i``
    for every ``i`` in ``pause_at``, and noting when each batch arrived and was handed over."""

    def __init__(self, reader, pause_at: set[int], on_pause) -> None:
        self.reader, self.pause_at, self.on_pause = reader, set(pause_at), on_pause
        self.arrived: list[float] = []
        self.resumed: list[float] = []
        self.sizes: list[int] = []

    @property
    def epoch(self) -> int:
        return self.reader.epoch

    def __iter__(self):
        for batch in self.reader:
            i = len(self.arrived)
            t = time.perf_counter()
            if i in self.pause_at:
                self.on_pause(i)
            self.arrived.append(t)
            self.resumed.append(time.perf_counter())
            self.sizes.append(batch.size)
            yield batch

    def timed(self, first: int, last: int) -> tuple[int, float]:
        """Return (rows, seconds) of the intervals between fetches ``first .. last``, pauses excluded."""
        seconds = sum(self.arrived[i + 1] - self.resumed[i] for i in range(first, last))
        rows = sum(self.sizes[i + 1] for i in range(first, last))
        return rows, seconds

    def state_dict(self) -> dict:
        return self.reader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reader.load_state_dict(state)

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        from recsys.io.reader import ParquetReader

        return ParquetReader.merge_states(states)

    def close(self) -> None:
        self.reader.close()


def _window_phases(metrics_path: Path, first_step: int, pauses_s: dict[int, float], chunk: int) -> dict:
    """Return the trainer's mean per-step phase times (ms) over the windows after
    ``first_step``, the benchmark's pauses (seconds, by 1-based step) taken out of data_wait."""
    totals: dict[str, float] = {}
    steps = 0
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        if "event" in rec or rec["step"] <= first_step:
            continue
        lo = rec["step"] - chunk
        paused = sum(v for s, v in pauses_s.items() if lo < s <= rec["step"])
        for k, v in rec.items():
            if k.startswith("time/") and k.endswith("_ms"):
                name = k[len("time/"):-len("_ms")]
                total = v * chunk - (1000 * paused if name == "data_wait" else 0.0)
                totals[name] = totals.get(name, 0.0) + total
        steps += chunk
    return {k: v / steps for k, v in totals.items()} if steps else {}


# --------------------------------------------------------------------------- (b) the peer


def _pipelineable():
    from torchrec.streamable import Pipelineable

    class PeerBatch(Pipelineable):
        """The peer's batch: what torchrec's pipeline moves (nothing to move on CPU)."""

        def __init__(self, dense, labels, sparse) -> None:
            self.dense, self.labels, self.sparse = dense, labels, sparse

        def to(self, device, non_blocking: bool = False) -> "PeerBatch":
            return PeerBatch(self.dense.to(device, non_blocking=non_blocking),
                             self.labels.to(device, non_blocking=non_blocking),
                             self.sparse.to(device, non_blocking=non_blocking))

        def record_stream(self, stream) -> None:
            pass  # CPU tensors: no streams

        def pin_memory(self) -> "PeerBatch":
            return self

    return PeerBatch


class Peer:
    """(b): torchrec DMP with fused row-wise Adagrad, fed by our reader, folded keys."""

    def __init__(self, job, steps: int) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.embedding_types import EmbeddingComputeKernel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
        from torchrec.distributed.types import ShardingEnv, ShardingType
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        from recsys.io.reader import ParquetReader
        from recsys.model.arch import RankingModel
        from recsys.train.loop import lr_lambda

        if job.store.optimizer != "rowwise_adagrad":
            raise ValueError(f"the peer runs fused row-wise Adagrad; the job's store uses {job.store.optimizer}")
        if job.model.heads != 1:
            raise ValueError(f"the peer's model is traced by torch.fx, which runs one head; the job has "
                             f"model.heads = {job.model.heads}, expected 1 for the torchrec arm")
        if dist.is_initialized():
            raise RuntimeError("the train benchmark needs a process without a torch.distributed group")
        schema, tc, sc = job.schema, job.train, job.store
        self.job = job
        F, N = len(schema.sparse), len(schema.dense)
        (D,) = {t.dim for t in schema.tables.values()}
        self.F, self.D = F, D
        tables = []
        for name, spec in schema.tables.items():
            feats = schema.features_of_table(name)
            poolings = {f.pooling for f in feats}
            if len(poolings) != 1:
                raise ValueError(f"table {name}: its features pool differently ({sorted(poolings)})")
            a = sc.init_bound(spec.dim)
            tables.append(EmbeddingBagConfig(
                name=name, embedding_dim=spec.dim, num_embeddings=_table_rows(spec),
                feature_names=[f.name for f in feats],
                pooling=PoolingType.MEAN if poolings.pop() == "mean" else PoolingType.SUM,
                weight_init_min=-a, weight_init_max=a,
            ))
        rows_of = {f.name: _table_rows(schema.tables[f.table]) for f in schema.sparse}
        self.rows_F = torch.tensor([rows_of[f] for f in schema.feature_names], dtype=torch.int64)
        self.table_rows = {t.name: t.num_embeddings for t in tables}

        torch.manual_seed(tc.seed)  # the dense model starts like ours
        self.dense_model = RankingModel(job.model, N, F, D)
        dense_model = self.dense_model

        class PeerModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
                self.dense_model = dense_model
                self.perm = None  # feature order of the pooled output, if not the schema's

            def forward(self, batch):
                pooled = self.ebc(batch.sparse).values().view(-1, F, D)
                if self.perm is not None:
                    pooled = pooled[:, self.perm]
                logits = self.dense_model(batch.dense, pooled)
                loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)  # fx-traced: one head
                return loss, logits.detach()

        self._port = free_port()
        with _silent():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self._port}", rank=0, world_size=1)
            sharder = EmbeddingBagCollectionSharder(fused_params={
                "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                "learning_rate": sc.lr,
                "eps": sc.eps,
                "weight_decay": sc.weight_decay,
            })
            model = PeerModel()
            # every table on the fused kernel (left alone, the planner makes the smallest
            # tables data-parallel dense ones, which the fused optimizer does not update)
            constraints = {
                t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                             compute_kernels=[EmbeddingComputeKernel.FUSED.value])
                for t in tables
            }
            planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                               constraints=constraints)
            plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
            self.dmp = DistributedModelParallel(
                model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                sharders=[sharder], plan=plan,
            )
        self.plan = str(plan)
        self.kernels = sorted({str(ps.compute_kernel) for m in plan.plan.values() for ps in m.values()})
        if self.kernels != [EmbeddingComputeKernel.FUSED.value]:
            raise RuntimeError(f"the planner did not put every table on the fused kernel: {self.kernels}")
        self.peer_batch = _pipelineable()
        order = self._pooled_order(model)
        if order != schema.feature_names:
            model.perm = torch.tensor([order.index(f) for f in schema.feature_names])
        self.opt = torch.optim.Adam(dense_model.parameters(), lr=tc.optim.lr, weight_decay=tc.optim.weight_decay,
                                    foreach=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(tc.schedule, steps))
        self.pipeline = TrainPipelineSparseDist(self.dmp, self.opt, torch.device("cpu"))
        self.reader = ParquetReader(job.data.train, schema)
        self._batches = self._folded(iter(self.reader), steps)
        self.steps = 0
        self.timed_rows = 0
        self.timed_s: list[float] = []

    def _pooled_order(self, model) -> list[str]:
        """Return the feature order of the sharded collection's pooled output."""
        import torch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        names = self.job.schema.feature_names
        kjt = KeyedJaggedTensor(keys=names, values=torch.zeros(len(names), dtype=torch.int64),
                                lengths=torch.ones(len(names), dtype=torch.int32))
        with torch.no_grad():
            return list(model.ebc(kjt).keys())

    def fold(self, batch):
        """Return the peer's batch: the hashed keys folded to their table's rows."""
        import torch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = batch.sparse
        values = kjt.values()
        rows = torch.repeat_interleave(self.rows_F, torch.tensor(kjt.length_per_key()), output_size=values.numel())
        folded = KeyedJaggedTensor(
            keys=kjt.keys(), values=torch.remainder(values, rows), lengths=kjt.lengths(), stride=kjt.stride(),
            length_per_key=kjt.length_per_key(), offset_per_key=kjt.offset_per_key(),
        )
        return self.peer_batch(batch.dense, batch.labels, folded)

    def _folded(self, batches, limit: int):
        for i, batch in enumerate(batches):
            if i == limit:
                return
            yield self.fold(batch)

    def run(self, n: int, timed: bool) -> None:
        """Train ``n`` more steps."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.pipeline.progress(self._batches)
            self.sched.step()
            self.steps += 1
        dt = time.perf_counter() - t0
        if timed:
            self.timed_s.append(dt)
            self.timed_rows += n * self.job.data.train.batch_size

    def evaluate(self) -> dict:
        """Return the eval split's metrics of the trained peer (whole split)."""
        import torch

        from recsys.eval.metrics import evaluate_predictions
        from recsys.io.reader import ParquetReader

        self.pipelined = [type(m).__name__ for m in self.pipeline._pipelined_modules]
        model = self.pipeline.detach()
        model.eval()
        labels, preds = [], []
        with torch.no_grad(), ParquetReader(self.job.data.eval, self.job.schema) as reader:
            for batch in reader:
                _, logits = model(self.fold(batch))
                labels.append(batch.labels.numpy())
                preds.append(torch.sigmoid(logits).numpy())
        return evaluate_predictions(np.concatenate(labels), np.concatenate(preds))

    def close(self) -> None:
        import torch.distributed as dist

        self.reader.close()
        self.pipeline = self.dmp = None
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------- (c) the limit


class Limit:
    """(c): the dense model alone on pre-made in-memory batches."""

    def __init__(self, job, batch_size: int, n_batches: int) -> None:
        import torch

        from recsys.model.arch import RankingModel

        schema, tc = job.schema, job.train
        F, N = len(schema.sparse), len(schema.dense)
        (D,) = {t.dim for t in schema.tables.values()}
        torch.manual_seed(tc.seed)
        self.model = RankingModel(job.model, N, F, D)
        # the trainer's dense optimizer, as it runs it (foreach, ``train.runtime.optimizer_threads``)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=tc.optim.lr, weight_decay=tc.optim.weight_decay,
                                    foreach=True)
        self.optimizer_threads = tc.runtime.optimizer_threads
        g = torch.Generator().manual_seed(tc.seed)
        a = job.store.init_bound(D)
        self.batches = [
            (torch.randn(batch_size, N, generator=g),
             (torch.rand(batch_size, F, D, generator=g) * 2 - 1) * a,
             (torch.rand(batch_size, generator=g) < 0.17).float())
            for _ in range(n_batches)
        ]
        self.batch_size = batch_size
        self.steps = 0
        self.timed_rows = 0
        self.timed_s: list[float] = []

    def run(self, n: int, timed: bool) -> None:
        """Train ``n`` more steps."""
        import torch

        from recsys.train.loop import bce, torch_threads

        t0 = time.perf_counter()
        for _ in range(n):
            dense, pooled, labels = self.batches[self.steps % len(self.batches)]
            logits = self.model(dense, pooled)
            loss = bce(logits, labels)
            self.opt.zero_grad(set_to_none=False)
            loss.backward()
            with torch_threads(self.optimizer_threads):
                self.opt.step()
            loss.item()
            self.steps += 1
        dt = time.perf_counter() - t0
        if timed:
            self.timed_s.append(dt)
            self.timed_rows += n * self.batch_size


class Alternation:
    """What (a)'s pauses run: segment 0 warms (b) and (c) up, each later one times a chunk
    of both, (b) first in odd segments and (c) first in even ones."""

    def __init__(self, peer: Peer, limit: Limit, s: Settings) -> None:
        self.peer, self.limit, self.s = peer, limit, s
        self.segments = 0
        self.pauses_s: dict[int, float] = {}  # 1-based trainer step -> seconds paused

    def __call__(self, batch_index: int) -> None:
        t0 = time.perf_counter()
        if self.segments == 0:
            with _silent():  # the pipeline's first step traces the model: one-time notices
                self.peer.run(self.s.warmup_steps + 1, timed=False)
            self.limit.run(self.s.chunk, timed=False)
        else:
            order = (self.peer, self.limit) if self.segments % 2 else (self.limit, self.peer)
            for side in order:
                side.run(self.s.chunk, timed=True)
        self.segments += 1
        # batch i is fetched during 0-based step i - 1, i.e. the trainer's step count i
        self.pauses_s[batch_index] = time.perf_counter() - t0


# --------------------------------------------------------------------------- 2 processes


def _train_rows(root: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in sorted((root / "train").glob("*.parquet")))


def _largest_row_group(root: Path) -> int:
    import pyarrow.parquet as pq

    sizes = [0]
    for f in sorted((root / "train").glob("*.parquet")):
        meta = pq.ParquetFile(f).metadata
        sizes += [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    return max(sizes)


def steps_each_rank_surely_has(train_rows: int, largest_row_group: int, batch_size: int, world: int = 2) -> int:
    """Return the steps of ``batch_size // world`` rows every rank of ``world`` surely has data
    for: units are dealt by rows, so ranks differ by at most one row group."""
    return (train_rows - largest_row_group) // world // (batch_size // world)


def _check_rank_data(root: Path, s: Settings, world: int = 2) -> None:
    """Fail (one line) unless every rank of ``world`` surely has data for all steps (a rank
    out of data would feed empty batches: not the steady state to measure)."""
    surely = steps_each_rank_surely_has(_train_rows(root), _largest_row_group(root), s.batch_size, world)
    if s.steps > surely:
        raise UserError(f"bench train: {root}: {s.steps} steps of {s.batch_size // world} rows per rank may "
                        f"run a rank out of data (each surely has {surely}); use fewer steps or more data")


def _cli_train(root: Path, s: Settings, run_dir: Path, world: int) -> dict:
    """Return ``recsys train --nproc world`` (batch B / world a rank, ``s.threads`` torch
    threads in one process, 1 in each of several): steady samples/s and where it came from."""
    threads = s.threads if world == 1 else 1
    overrides = [
        f"data.train.paths=['{root / 'train'}']",
        "data.eval.paths=[]",  # no final evaluation: only the throughput is wanted
        f"data.train.batch_size={s.batch_size // world}",
        "train.epochs=1",
        f"train.max_steps={s.steps}",
        f"train.runtime.threads={threads}",
        f"train.log_every={s.chunk}",
        "train.progress='none'",
        *([] if s.lr_warmup_steps is None else [f"train.schedule.warmup_steps={s.lr_warmup_steps}"]),
    ]
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--nproc", str(world), "--config", s.job,
           "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=s.scaling_timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]
        raise RuntimeError(f"{world}-process training failed ({proc.returncode}): {' | '.join(errors[-5:])}\n"
                           f"{proc.stderr[-4000:]}")
    rows = seconds = 0.0
    phases: dict[str, float] = {}
    window_rows = s.chunk * (s.batch_size // world) * world
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" in rec or rec["step"] <= s.warmup_steps:
            continue
        rows += window_rows
        seconds += window_rows / rec["throughput/samples_per_s"]
        for k, v in rec.items():
            if k.startswith("time/") and k.endswith("_ms"):
                phases[k[5:-3]] = phases.get(k[5:-3], 0.0) + v * s.chunk
    steps = rows / (s.batch_size // world * world)
    return {
        "samples_per_s": rows / seconds,
        "timed_rows": int(rows),
        "timed_seconds": seconds,
        "rank0_phase_ms_per_step": {k: v / steps for k, v in phases.items()},
        "wall_seconds_incl_startup": wall,
        "batch_per_rank": s.batch_size // world,
        "threads_per_rank": threads,
    }


def _scaling(root: Path, s: Settings, run_dir: Path) -> dict:
    """Return ``recsys train`` in 1 and in 2 processes, ``s.scaling_rounds`` rounds of both
    (the order swapped every round): each side's rounds and totals, and the paired ratios."""
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for r in range(s.scaling_rounds):
        for world in ((1, 2) if r % 2 == 0 else (2, 1)):
            runs[world].append(_cli_train(root, s, run_dir / f"round{r}-nproc{world}", world))
    out = {}
    for world, name in ((1, "one_process"), (2, "two_processes")):
        rows = sum(x["timed_rows"] for x in runs[world])
        seconds = sum(x["timed_seconds"] for x in runs[world])
        out[name] = {**runs[world][-1], "samples_per_s": rows / seconds, "timed_rows": rows, "timed_seconds": seconds,
                     "rounds": runs[world]}
    out["paired"] = paired_ratio([x["timed_seconds"] for x in runs[2]], [x["timed_seconds"] for x in runs[1]])
    return out


# --------------------------------------------------------------------------- entry


def measure(quick: bool, data: Path | None = None, settings: Settings | None = None) -> dict:
    """Return the four comparisons (``settings`` overrides the preset sizes)."""
    s = settings if settings is not None else (QUICK if quick else FULL)
    root = ensure_data(quick, data)
    if s.scaling:
        _check_rank_data(root, s)  # before any work: a bench too big for its data is one line

    def run() -> dict:
        with quiet_fbgemm():
            import torchrec  # noqa: F401 - loads fbgemm, which logs a line per library
        return _measure_all(root, s)

    return with_passive_omp(run)


def _measure_all(root: Path, s: Settings) -> dict:
    import torch

    from recsys.io.reader import ParquetReader
    from recsys.train.loop import Trainer, setup_env

    seconds: dict[str, float] = {}
    job = load_bench_job(root, s)
    oracle = json.loads((root / "oracle.json").read_text()) if (root / "oracle.json").exists() else {}
    with tempfile.TemporaryDirectory(prefix="recsys-bench-train-") as tmp:
        t0 = time.perf_counter()
        reader = ParquetReader(job.data.train, job.schema)
        available = reader.stats["rows_per_epoch"] // s.batch_size
        if available < s.steps:
            reader.close()
            raise UserError(f"bench train: {root}: {available} full batches of {s.batch_size} rows; "
                            f"the run needs {s.steps}")
        pause_at = {s.warmup_steps + i * s.chunk for i in range(s.timed_chunks + 1)}
        source = PausingSource(reader, pause_at, on_pause=None)
        # ours first: its store is built before the peer's process group exists, as in a
        # one-process run
        trainer = Trainer(job, Path(tmp) / "ours", setup_env("cpu"), source=source)
        peer = Peer(job, s.steps)
        limit = Limit(job, s.batch_size, s.dense_batches)
        alternate = Alternation(peer, limit, s)
        source.on_pause = alternate
        seconds["build"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            ours_result = trainer.train()
        finally:
            trainer.close()
        seconds["alternating_training_and_ours_eval"] = time.perf_counter() - t0
        if alternate.segments != s.timed_chunks + 1 or peer.steps != s.steps or trainer.step != s.steps:
            raise RuntimeError(f"schedule broken: {alternate.segments} segments, peer {peer.steps} steps, "
                               f"ours {trainer.step} steps (want {s.steps})")
        t0 = time.perf_counter()
        peer_eval = peer.evaluate()
        seconds["peer_eval"] = time.perf_counter() - t0
        plan, kernels, pipelined, table_rows = peer.plan, peer.kernels, peer.pipelined, peer.table_rows
        peer.close()

        ours_rows, ours_s = source.timed(s.warmup_steps, s.steps - 1)
        ours_segments = [source.timed(s.warmup_steps + i * s.chunk, s.warmup_steps + (i + 1) * s.chunk)[1]
                         for i in range(s.timed_chunks)]
        rate = {
            "ours": ours_rows / ours_s,
            "torchrec": peer.timed_rows / sum(peer.timed_s),
            "dense_only": limit.timed_rows / sum(limit.timed_s),
        }
        phases = _window_phases(Path(tmp) / "ours" / "metrics.jsonl", s.warmup_steps, alternate.pauses_s, s.chunk)
        scaling = None
        if s.scaling:
            t0 = time.perf_counter()
            scaling = _scaling(root, s, Path(tmp) / "scaling")
            seconds["one_and_two_processes"] = time.perf_counter() - t0

    auc_ours, auc_peer = ours_result.get("auc", float("nan")), peer_eval.get("auc", float("nan"))
    comparisons = [
        comparison("ours vs torchrec DMP fused", rate["ours"], rate["torchrec"], "samples/s", target_ratio=1.2,
                   **paired_ratio(ours_segments, peer.timed_s)),
        comparison("ours vs dense-only limit", rate["ours"], rate["dense_only"], "samples/s", target_ratio=0.8,
                   **paired_ratio(ours_segments, limit.timed_s)),
    ]
    if scaling is not None:
        comparisons.append(comparison("2 processes vs 1 (ours)", scaling["two_processes"]["samples_per_s"],
                                      scaling["one_process"]["samples_per_s"], "samples/s", target_ratio=1.0,
                                      **scaling["paired"]))
    comparisons.append(comparison(
        "AUC ours vs torchrec", auc_ours, auc_peer, "AUC",
        auc_ours=auc_ours, auc_torchrec=auc_peer, auc_difference=auc_ours - auc_peer,
        target_difference=-0.002, oracle_auc=oracle.get("eval", {}).get("auc"),
    ))
    return {
        "comparisons": comparisons,
        "details": {
            "ours": {
                "samples_per_s": rate["ours"],
                "timed_rows": ours_rows,
                "timed_seconds": ours_s,
                "seconds_per_segment": ours_segments,
                "phase_ms_per_step": phases,
                "eval": ours_result,
            },
            "torchrec": {
                "samples_per_s": rate["torchrec"],
                "timed_rows": peer.timed_rows,
                "seconds_per_segment": peer.timed_s,
                "eval": peer_eval,
                "pipeline": "TrainPipelineSparseDist",
                "pipelined_modules": pipelined,
                "compute_kernels": kernels,
                "table_rows": table_rows,
                "plan": plan,
            },
            "dense_only": {
                "samples_per_s": rate["dense_only"],
                "timed_rows": limit.timed_rows,
                "seconds_per_segment": limit.timed_s,
            },
            "one_process": None if scaling is None else scaling["one_process"],
            "two_processes": None if scaling is None else scaling["two_processes"],
            "pauses_s": alternate.pauses_s,
        },
        "settings": {
            **dataclasses.asdict(s),
            "steps": s.steps,
            "warmup_steps": s.warmup_steps,
            "timed_steps": s.timed_steps,
            "samples_trained": s.steps * s.batch_size,
            "data": str(root),
            "train_rows": reader.stats["rows_per_epoch"],
            **job_settings(job),
            "peer_input": "our reader (same batches), keys folded by torch.remainder per batch, timed",
        },
        "versions": versions(),
        "seconds_per_part": seconds,
    }
