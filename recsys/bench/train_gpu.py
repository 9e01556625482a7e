"""``recsys bench train --device cuda``: our trainer on one GPU against plain PyTorch, torchrec
and the dense model alone.

One run, one GPU, one data set, one model (``model_for(job)``: the job's DLRM and dims), one
batch size ``B`` (16384), the same batches in the same order for every side that reads:

(a)  **ours, tables on the GPU**: the real ``Trainer`` with ``train.device = 'cuda'`` and
     ``store.device.memory_gb`` large enough that every table's whole capacity is a device
     cache (the GPU tier: rows gathered, pooled and updated on the GPU; only a key's first
     sighting crosses from the host). The run checks that every table got its capacity.
(a2) **ours, GPU cache**: ``store.device.cache_rows`` = ``cache_fraction`` (10 %) of the
     largest table's capacity, for every table (one number for all tables: the 1 M-row
     tables cache 10 %, tables smaller than that fit whole; the JSON gives the total).
(a3) **ours, store on the host**: no device cache; rows cross to the GPU every step.
(k)  **ours, device key map** (``store.device.key_map = "device"``): (a)'s whole tables with
     the key work on the GPU too (``recsys.store.device.keymap``: only keys and lengths cross).
(k2) **ours, device key map with a GPU cache**: (a2)'s ``cache_rows`` in front of host tables
     (``recsys.store.device.cached``), the host asked for each step's misses one step ahead.
(b)  **plain PyTorch**, what users write first: one ``nn.EmbeddingBag(sparse=True)`` per
     table on the GPU, pre-sized to the row budget ours gets (``num_rows`` or ``capacity``)
     and started like ours (U(-a, a)); ``torch.optim.Adagrad`` (the store's lr and eps) on
     the sparse parameters, Adam on the dense model as the trainer runs it. Its batches come
     from our reader (same seed: the same batches as (a)), moved with ``.to(device)`` and
     each feature's hashed keys folded to its table's rows by ``torch.remainder`` on the
     GPU, inside the timed loop.
(c)  **torchrec** ``DistributedModelParallel`` with fbgemm's TBE. On ``device = "cpu"`` (the
     tests' tiny run) it is ``recsys.bench.train.Peer``, the CPU bench's peer. On CUDA it is
     skipped, with the reason in the notes and the JSON: fbgemm's CPU build has no CUDA TBE,
     and ``Peer`` itself is CPU-only (gloo group, CPU topology and pipeline).
(d)  **the dense-only limit**: the same model's forward, backward and dense optimizer step
     on a few pre-made batches already on the GPU (random dense ``[B, N]`` and pooled
     ``[B, F, D]``): ``recsys.bench.train.Limit``'s batches, moved to the device.

Timing: each side trains ``warmup_chunks × chunk (+1)`` untimed steps, then
``timed_chunks`` timed segments of ``chunk`` steps each, the sides taking turns segment by
segment (the order rotates by one side each round, so every side runs in every position).
A segment starts after ``torch.cuda.synchronize()`` and ends after another: samples/s =
rows of the timed steps / their seconds; the JSON adds each side's per-segment median and
min-max, and each ratio's paired median and min-max (``paired_ratio``: the segments of one round,
run back to back, a noisy moment slowing both). (a), (a2) and (a3) each run in a process of
their own (spawned; a ``Trainer`` owns its process's signal handler and store threads),
paused inside their batch fetch as the CPU bench pauses its (a) (``PausingSource``): there
the store's worker and the reader wait for the next lookup, so a paused side holds no GPU
work. Their segments are timed in their own process, synchronized at both ends, from the
moment the parent lets them go; (b), (c), (d) run in the parent. One GPU context per
process: only one side works at a time.

Also: the GPU's name; the store's hit rates over the timed steps (host ``hits / (hits +
misses)``, the metrics' ``store/hit_rate``, and the device cache's ``cache_hits /
(cache_hits + cache_misses)``); the trainer's phase times per step; AUC on the whole eval
split after the same steps for every side that trains.

Full: the ``small`` synthetic set (1.8 M rows; generated if missing), B = 16384, 101 steps
(2 warm-up segments, 8 timed, of 10 steps), dense LR warm-up of 20 steps (the job's 100
would span the whole run). ``--quick``: a 400 k-row set of the same shape
(``bench-out/data/train-gpu-quick``), 21 steps (1 warm-up segment, 4 timed, of 4 steps), no
LR warm-up. No assertions on timings. Without a GPU, ``--device cuda`` exits with one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from recsys.bench import comparison, paired_ratio, with_passive_omp, quiet_fbgemm, train, versions
from recsys.bench.train import ROOT, Limit, PausingSource, Peer, _silent, _table_rows, _window_phases, load_bench_job

QUICK_DATA = ROOT / "bench-out" / "data" / "train-gpu-quick"

OURS = ("ours", "ours_cache", "ours_host", "ours_keymap", "ours_keymap_cache")
"""(a), (a2), (a3): the store's GPU tier holding whole tables, a GPU cache, no GPU rows; (k),
(k2): the device key map holding whole tables, and as a GPU cache in front of host tables."""


@dataclasses.dataclass(frozen=True)
class Settings(train.Settings):
    """Sizes of one run (``FULL``, ``QUICK``; tests pass tiny ones, on ``device="cpu"`` too).
    The CPU bench's settings (``chunk``: steps per timed segment and per metrics window of the
    trainers; ``steps``, ``warmup_steps``, ``timed_steps``) with the GPU run's defaults; its
    ``scaling`` (2 processes) is not run here."""

    batch_size: int = 16384
    chunk: int = 10
    timed_chunks: int = 8
    threads: int = 0
    """Torch threads of every process (0: every core)."""
    scaling: bool = False
    lr_warmup_steps: int | None = 20
    device: str = "cuda"
    """Where every side trains ("cpu": the tests' variant of the same code)."""
    device_memory_gb: float = 64.0
    """(a)'s ``store.device.memory_gb``: a cap, not an allocation; must hold every table."""
    cache_fraction: float = 0.1
    """(a2)'s ``store.device.cache_rows``: this share of the largest table's capacity."""
    child_timeout_s: float = 1800.0
    """How long the parent waits for one message of a trainer's process."""
    reader_workers: int = 4
    """``data.train.num_workers`` of every side that reads (the GPU outruns one reading
    thread at B 16384: ~440 k rows/s measured on an H100 host without workers)."""


FULL = Settings()
QUICK = Settings(chunk=4, warmup_chunks=1, timed_chunks=4, lr_warmup_steps=0)


def _quick_preset():
    from recsys.io.synth import Preset

    return Preset(name="bench-train-gpu-quick", train_rows=400_000, eval_rows=50_000,
                  rows_per_file=131_072, row_group_size=32_768)


def ensure_data(quick: bool, data: Path | None) -> Path:
    """Return the data directory of the run (``recsys.bench.train.ensure_data`` with this
    bench's quick set)."""
    return train.ensure_data(quick, data, QUICK_DATA, _quick_preset() if quick and data is None else None)


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _dense_optimizer(params, tc):
    """Return the trainer's dense optimizer over ``params``, built as ``Trainer`` builds it."""
    import torch

    opt_cls = torch.optim.Adam if tc.optim.name == "adam" else torch.optim.Adagrad
    impl = {"fused": True} if tc.optim.fused else {"foreach": True}
    return opt_cls(params, lr=tc.optim.lr, weight_decay=tc.optim.weight_decay, **impl)


def _spread(seconds: list[float], rows: int) -> dict:
    """Return samples/s per segment of ``rows`` rows: median and [min, max]."""
    rates = [rows / s for s in seconds]
    return {"median_samples_per_s": statistics.median(rates), "min_max_samples_per_s": [min(rates), max(rates)]}


# --------------------------------------------------------------------------- (a) ours


def _variant_overrides(job, s: Settings) -> dict[str, list[str]]:
    """Return the store overrides of (a), (a2), (a3)."""
    largest = max(spec.capacity for spec in job.schema.tables.values())
    cache_rows = max(1, int(round(s.cache_fraction * largest)))
    return {
        "ours": [f"store.device.memory_gb={float(s.device_memory_gb)}", "store.device.cache_rows=0"],
        "ours_cache": ["store.device.memory_gb=0.0", f"store.device.cache_rows={cache_rows}"],
        "ours_host": ["store.device.memory_gb=0.0", "store.device.cache_rows=0"],
        "ours_keymap": [f"store.device.memory_gb={float(s.device_memory_gb)}", "store.device.cache_rows=0",
                        "store.device.key_map='device'"],
        "ours_keymap_cache": ["store.device.memory_gb=0.0", f"store.device.cache_rows={cache_rows}",
                              "store.device.key_map='device'"],
    }


def _device_rows(job) -> dict[str, int]:
    """Return the device rows per table the job's store gets (one process)."""
    from recsys.store.device.cache import device_budget_rows

    cfg = job.store
    if cfg.device.cache_rows:
        return {name: cfg.device.cache_rows for name in job.schema.tables}
    return device_budget_rows(dict(job.schema.tables), cfg)


class _Baton:
    """A trainer's pause (``PausingSource.on_pause``): synchronize, report the segment just
    ended to the parent, wait to be let go."""

    def __init__(self, conn, device, source: PausingSource) -> None:
        self.conn, self.device, self.source = conn, device, source
        self.trainer = None
        self.previous: int | None = None  # batch index of the previous pause
        self.counters: list[dict[str, int]] = []  # the store's summed counters at each pause
        self.pauses_s: dict[int, float] = {}  # batch index (= the trainer's 1-based step) -> seconds

    def __call__(self, i: int) -> None:
        from recsys.train.metrics import _sum_counters

        _sync(self.device)
        t = time.perf_counter()
        seconds = None if self.previous is None else t - self.source.resumed[self.previous]
        self.counters.append(_sum_counters(self.trainer.store.counters()))
        self.conn.send(("paused", seconds))
        if self.conn.recv() != "go":
            raise RuntimeError("the benchmark's parent stopped the run")
        self.previous = i
        self.pauses_s[i] = time.perf_counter() - t


def _hit_rates(first: dict[str, int], last: dict[str, int]) -> dict:
    d = {k: last.get(k, 0) - first.get(k, 0) for k in last}
    host = d.get("hits", 0) + d.get("misses", 0)
    cache = d.get("cache_hits", 0) + d.get("cache_misses", 0)
    return {
        "store_hit_rate": d.get("hits", 0) / host if host else None,
        "device_cache_hit_rate": d.get("cache_hits", 0) / cache if cache else None,
        "counters_timed": d,
    }


def _metrics_hit_rate(path: Path, first_step: int) -> float | None:
    """Return the mean ``store/hit_rate`` of the metrics windows after ``first_step``."""
    rates = [rec["store/hit_rate"] for rec in map(json.loads, path.read_text().splitlines())
             if "event" not in rec and rec["step"] > first_step]
    return sum(rates) / len(rates) if rates else None


def _ours_child(conn, root: str, s: Settings, overrides: list[str], run_dir: str) -> None:
    """One of (a), (a2), (a3), in its own process: build, report ready, train in segments
    when told, report the result. Leaves with ``os._exit`` (see ``recsys.runtime.spawn._entry``)."""
    trainer = None
    try:
        with quiet_fbgemm():
            import torchrec  # noqa: F401 - loads fbgemm, which logs a line per library
        from recsys.io.reader import ParquetReader
        from recsys.train.loop import Trainer, setup_env

        job = load_bench_job(Path(root), s, *overrides)
        pause_at = {s.warmup_steps + i * s.chunk for i in range(s.timed_chunks + 1)}
        source = PausingSource(ParquetReader(job.data.train, job.schema), pause_at, on_pause=None)
        env = setup_env(job.train.device)
        baton = _Baton(conn, env.device, source)
        source.on_pause = baton
        trainer = baton.trainer = Trainer(job, Path(run_dir), env, source=source)
        conn.send(("ready", None))
        if conn.recv() != "go":
            return
        result = trainer.train()
        metrics = Path(run_dir) / "metrics.jsonl"
        conn.send(("done", {
            "eval": result,
            "hit_rates": {**_hit_rates(baton.counters[0], baton.counters[-1]),
                          "metrics_store_hit_rate": _metrics_hit_rate(metrics, s.warmup_steps)},
            "counters_end": baton.counters[-1],
            "phase_ms_per_step": _window_phases(metrics, s.warmup_steps, baton.pauses_s, s.chunk),
            "steps": trainer.step,
        }))
    except BaseException:  # noqa: BLE001 - the parent raises it with the child's traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        try:
            if trainer is not None:
                trainer.close()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            conn.close()
            os._exit(0)


class OursProcess:
    """The parent's handle on one trainer process."""

    def __init__(self, name: str, root: Path, s: Settings, overrides: list[str], run_dir: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name, self.s = name, s
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_ours_child, args=(child, str(root), s, overrides, str(run_dir)),
                                name=f"bench-{name}", daemon=False)  # its reader starts worker processes
        self.proc.start()
        child.close()
        self.timed_s: list[float] = []
        self.timed_rows = 0
        self.result: dict | None = None

    def _recv(self, want: str):
        deadline = time.monotonic() + self.s.child_timeout_s
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.name}: its process exited ({self.proc.exitcode}) without a word")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {want!r} within {self.s.child_timeout_s} s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.proc.join(timeout=10)
            raise RuntimeError(f"{self.name}: its process ended ({self.proc.exitcode}) without a word") from None
        if kind == "error":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        if kind != want:
            raise RuntimeError(f"{self.name}: got {kind!r}, expected {want!r}")
        return value

    def ready(self) -> None:
        self._recv("ready")

    def warm(self) -> None:
        self.conn.send("go")
        self._recv("paused")

    def segment(self) -> float:
        self.conn.send("go")
        seconds = self._recv("paused")
        self.timed_s.append(seconds)
        self.timed_rows += self.s.chunk * self.s.batch_size
        return seconds

    def finish_start(self) -> None:
        self.conn.send("go")

    def finish(self) -> dict:
        self.result = self._recv("done")
        self.proc.join(timeout=60)
        return self.result["eval"]

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(timeout=30)
        if self.proc.is_alive():  # not a daemon (see __init__): never leave it behind
            self.proc.kill()
            self.proc.join()
        self.conn.close()


# --------------------------------------------------------------------------- (b), (d): in this process


class _Segments:
    """``run(n, timed)`` of a side trained in this process: ``n`` steps of ``_step``, timed
    between two synchronizations of ``self.device``; a timed run's seconds are kept."""

    device = None
    batch_size: int
    timed_s: list[float]
    timed_rows: int

    def _step(self) -> None:
        raise NotImplementedError

    def _stepping(self):
        """Return the context the steps run in."""
        return contextlib.nullcontext()

    def run(self, n: int, timed: bool) -> float:
        """Train ``n`` more steps; return their seconds."""
        _sync(self.device)
        t0 = time.perf_counter()
        with self._stepping():
            for _ in range(n):
                self._step()
        _sync(self.device)
        dt = time.perf_counter() - t0
        if timed:
            self.timed_s.append(dt)
            self.timed_rows += n * self.batch_size
        return dt

    def close(self) -> None:
        pass


class PlainTorch(_Segments):
    """(b): ``nn.EmbeddingBag(sparse=True)`` per table, Adagrad on them, fed by our reader."""

    def __init__(self, job, steps: int, device) -> None:
        import torch
        from torch import nn

        from recsys.io.reader import ParquetReader
        from recsys.model.arch import model_for
        from recsys.train.loop import lr_lambda

        schema, tc, sc = job.schema, job.train, job.store
        if schema.needs_dense_stats or schema.weight or any(f.weighted for f in schema.sparse):
            raise ValueError("plain PyTorch side: dense statistics, sample weights and weighted features "
                             "are not wired in")
        if sc.weight_decay:
            raise ValueError("plain PyTorch side: torch's Adagrad takes no weight decay on sparse gradients")
        self.job, self.device = job, torch.device(device)
        self.batch_size = job.data.train.batch_size
        bags = {}
        for name, spec in schema.tables.items():
            poolings = {f.pooling for f in schema.features_of_table(name)}
            if len(poolings) != 1:
                raise ValueError(f"table {name}: its features pool differently ({sorted(poolings)})")
            bag = nn.EmbeddingBag(_table_rows(spec), spec.dim, mode=poolings.pop(), sparse=True,
                                  include_last_offset=True)
            a = sc.init_bound(spec.dim)
            nn.init.uniform_(bag.weight, -a, a)
            bags[name] = bag
        self.bags = nn.ModuleDict(bags).to(self.device)
        self.features = [(f.table, _table_rows(schema.tables[f.table])) for f in schema.sparse]
        torch.manual_seed(tc.seed)  # the dense model starts like ours
        self.model = model_for(job).to(self.device)
        self.sparse_opt = torch.optim.Adagrad(self.bags.parameters(), lr=sc.lr, eps=sc.eps)
        self.opt = _dense_optimizer(self.model.parameters(), tc)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(tc.schedule, steps))
        self.reader = ParquetReader(job.data.train, schema)
        self._batches = iter(self.reader)
        self.steps = 0
        self.timed_rows = 0
        self.timed_s: list[float] = []

    def pooled(self, kjt):
        """Return pooled embeddings [B, F, D] of a batch's hashed keys (folded per feature)."""
        import torch

        values = kjt.values().to(self.device)
        B = kjt.stride()
        offsets = torch.zeros((len(self.features), B + 1), dtype=torch.int64, device=self.device)
        offsets[:, 1:] = torch.cumsum(kjt.lengths().to(self.device).view(len(self.features), B), dim=1)
        out = []
        for f, ((table, rows), start, n) in enumerate(zip(self.features, kjt.offset_per_key(), kjt.length_per_key())):
            ids = torch.remainder(values[start:start + n], rows)
            out.append(self.bags[table](ids, offsets[f]))
        return torch.stack(out, dim=1)

    def _step(self) -> None:
        import torch

        from recsys.train.loop import bce

        batch = next(self._batches)
        dense, labels = batch.dense.to(self.device), batch.labels.to(self.device)
        logits = self.model(dense, self.pooled(batch.sparse))
        loss = bce(logits, labels)
        self.sparse_opt.zero_grad()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.sparse_opt.step()
        self.opt.step()
        self.sched.step()
        self.steps += 1

    def _stepping(self):
        import torch

        # Adagrad builds sparse tensors of the gradients' rows: valid by construction, no checks
        # (said explicitly: torch warns where the choice is left implicit)
        return torch.sparse.check_sparse_tensor_invariants(enable=False)

    def evaluate(self) -> dict:
        """Return the eval split's metrics (whole split)."""
        import torch

        from recsys.eval.metrics import evaluate_predictions
        from recsys.io.reader import ParquetReader

        self.model.eval()
        labels, preds = [], []
        with torch.no_grad(), ParquetReader(self.job.data.eval, self.job.schema) as reader:
            for batch in reader:
                logits = self.model(batch.dense.to(self.device), self.pooled(batch.sparse))
                labels.append(batch.labels.numpy())
                preds.append(torch.sigmoid(logits).cpu().numpy())
        self.model.train()
        return evaluate_predictions(np.concatenate(labels), np.concatenate(preds))

    def close(self) -> None:
        self.reader.close()


# --------------------------------------------------------------------------- (c) torchrec


def torchrec_skip_reason(device) -> str | None:
    """Return why (c) cannot run on ``device`` (None: it runs)."""
    import torch

    if torch.device(device).type == "cpu":
        return None
    try:
        with quiet_fbgemm():
            import fbgemm_gpu
            import torchrec  # noqa: F401
    except ImportError as exc:
        return f"torchrec or fbgemm_gpu not importable: {exc}"
    variant = getattr(fbgemm_gpu, "__variant__", "?")
    if variant != "cuda":
        return (f"fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')} is its {variant!r} build: "
                f"no CUDA TBE for torchrec DMP")
    return ("fbgemm_gpu has CUDA, but recsys.bench.train.Peer is CPU-only (gloo group, CPU topology and "
            "pipeline): a CUDA peer needs it to take a device")


class TorchrecSide:
    """(c) on CPU: the CPU bench's peer (torchrec DMP, fused TBE), in segments."""

    def __init__(self, job, steps: int) -> None:
        self.peer = Peer(job, steps)

    @property
    def timed_s(self) -> list[float]:
        return self.peer.timed_s

    @property
    def timed_rows(self) -> int:
        return self.peer.timed_rows

    def run(self, n: int, timed: bool) -> float:
        if not timed:
            with _silent():  # the pipeline's first step traces the model: one-time notices
                self.peer.run(n, timed=False)
            return 0.0
        self.peer.run(n, timed=True)
        return self.peer.timed_s[-1]

    def evaluate(self) -> dict:
        return self.peer.evaluate()

    def close(self) -> None:
        self.peer.close()


# --------------------------------------------------------------------------- (d) the limit


class DeviceLimit(_Segments, Limit):
    """(d): the dense model alone on pre-made batches on the device, with the trainer's
    dense optimizer; no per-step read of the loss (the trainer has none either)."""

    def __init__(self, job, batch_size: int, n_batches: int, device) -> None:
        import torch

        super().__init__(job, batch_size, n_batches)
        self.device = torch.device(device)
        self.model.to(self.device)
        self.opt = _dense_optimizer(self.model.parameters(), job.train)
        self.batches = [tuple(t.to(self.device) for t in b) for b in self.batches]

    def _step(self) -> None:
        import torch

        from recsys.train.loop import bce

        dense, pooled, labels = self.batches[self.steps % len(self.batches)]
        loss = bce(self.model(dense, pooled), labels)
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()
        self.steps += 1


# --------------------------------------------------------------------------- entry


def measure(quick: bool, data: Path | None = None, settings: Settings | None = None) -> dict:
    """Return the comparisons (``settings`` overrides the preset sizes)."""
    s = settings if settings is not None else (QUICK if quick else FULL)

    def run() -> dict:
        import torch

        if torch.device(s.device).type == "cuda" and not torch.cuda.is_available():
            from recsys.errors import UserError

            why = "no CUDA GPU visible" if torch.version.cuda else "built without CUDA"
            raise UserError(f"bench train --device cuda: needs a CUDA GPU; torch {torch.__version__}: {why}")
        root = ensure_data(quick, data)
        with quiet_fbgemm():
            import torchrec  # noqa: F401 - loads fbgemm, which logs a line per library
        return _measure_all(root, s)

    return with_passive_omp(run)


def _measure_all(root: Path, s: Settings) -> dict:
    import torch

    from recsys.io.reader import ParquetReader

    if s.device not in ("cpu", "cuda"):
        raise ValueError(f"Settings.device must be 'cpu' or 'cuda' (the first GPU), found {s.device!r}")
    device = torch.device("cuda", 0) if s.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(s.threads or os.cpu_count() or 1)
    seconds: dict[str, float] = {}
    on_device = [f"train.device='{s.device}'", f"data.train.num_workers={s.reader_workers}"]
    job = load_bench_job(root, s, *on_device)
    overrides = {name: [*on_device, *o] for name, o in _variant_overrides(job, s).items()}
    jobs = {name: load_bench_job(root, s, *o) for name, o in overrides.items()}
    device_rows = {name: _device_rows(j) for name, j in jobs.items()}
    short = {t: (device_rows["ours"].get(t, 0), spec.capacity) for t, spec in job.schema.tables.items()
             if device_rows["ours"].get(t, 0) < spec.capacity}
    if short:
        raise ValueError(f"store.device.memory_gb = {s.device_memory_gb} does not hold every table whole "
                         f"(device rows, capacity: {short}); raise Settings.device_memory_gb")
    oracle = json.loads((root / "oracle.json").read_text()) if (root / "oracle.json").exists() else {}
    with ParquetReader(job.data.train, job.schema) as reader:
        train_rows = reader.stats["rows_per_epoch"]
    if train_rows // s.batch_size < s.steps:
        raise ValueError(f"{root}: {train_rows // s.batch_size} full batches of {s.batch_size} rows; "
                         f"the run needs {s.steps}")
    skipped = {"torchrec": torchrec_skip_reason(device)}
    sides: dict = {}
    with tempfile.TemporaryDirectory(prefix="recsys-bench-train-gpu-") as tmp:
        try:
            t0 = time.perf_counter()
            for name in OURS:
                sides[name] = OursProcess(name, root, s, overrides[name], Path(tmp) / name)
            sides["plain_torch"] = PlainTorch(job, s.steps, device)
            if skipped["torchrec"] is None:
                sides["torchrec"] = TorchrecSide(job, s.steps)
            sides["dense_only"] = DeviceLimit(job, s.batch_size, s.dense_batches, device)
            for name in OURS:
                sides[name].ready()
            seconds["build"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            order = list(sides)
            for name in order:  # the untimed warm-up, one side after the other
                side = sides[name]
                side.warm() if name in OURS else side.run(s.warmup_steps + 1, timed=False)
            seconds["warmup"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for k in range(s.timed_chunks):
                for name in order[k % len(order):] + order[:k % len(order)]:
                    side = sides[name]
                    side.segment() if name in OURS else side.run(s.chunk, timed=True)
            seconds["timed"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            for name in OURS:  # the trainers' last step and evaluation, in parallel
                sides[name].finish_start()
            evals = {name: sides[name].evaluate() for name in sides if name not in OURS and name != "dense_only"}
            for name in OURS:
                evals[name] = sides[name].finish()
            seconds["finish_and_eval"] = time.perf_counter() - t0
        finally:
            for side in sides.values():
                side.close()

    timed_rows = s.timed_steps * s.batch_size
    details: dict = {}
    for name, side in sides.items():
        if side.timed_rows != timed_rows or len(side.timed_s) != s.timed_chunks:
            raise RuntimeError(f"schedule broken: {name} timed {side.timed_rows} rows in {len(side.timed_s)} "
                               f"segments (want {timed_rows} in {s.timed_chunks})")
        details[name] = {
            "samples_per_s": timed_rows / sum(side.timed_s),
            "timed_rows": timed_rows,
            "seconds_per_segment": side.timed_s,
            **_spread(side.timed_s, s.chunk * s.batch_size),
        }
        if name in evals:
            details[name]["eval"] = evals[name]
    for name in OURS:
        r = sides[name].result
        if r["steps"] != s.steps:
            raise RuntimeError(f"{name} trained {r['steps']} steps, want {s.steps}")
        rows = sum(min(device_rows[name].get(t, 0), spec.capacity) for t, spec in job.schema.tables.items())
        details[name].update({
            "overrides": overrides[name],
            "device_rows": rows,  # rows a table's device cache can hold, at most its capacity
            "device_rows_fraction_of_capacity": rows / sum(spec.capacity for spec in job.schema.tables.values()),
            **r["hit_rates"],
            "counters_end": r["counters_end"],
            "phase_ms_per_step": r["phase_ms_per_step"],
        })
    details["plain_torch"]["table_rows"] = {n: _table_rows(spec) for n, spec in job.schema.tables.items()}
    if skipped["torchrec"] is not None:
        details["torchrec"] = {"skipped": skipped["torchrec"]}

    rate = {name: d["samples_per_s"] for name, d in details.items() if "samples_per_s" in d}
    seg = {name: side.timed_s for name, side in sides.items()}
    comparisons = [
        comparison("ours (GPU tables) vs plain PyTorch EmbeddingBag", rate["ours"], rate["plain_torch"],
                   "samples/s", **paired_ratio(seg["ours"], seg["plain_torch"])),
        comparison("ours (GPU tables) vs dense-only limit", rate["ours"], rate["dense_only"], "samples/s",
                   **paired_ratio(seg["ours"], seg["dense_only"])),
        comparison(f"ours GPU cache {s.cache_fraction:.0%} vs store on host", rate["ours_cache"],
                   rate["ours_host"], "samples/s", **paired_ratio(seg["ours_cache"], seg["ours_host"])),
        comparison("ours device key map (GPU tables) vs plain PyTorch EmbeddingBag", rate["ours_keymap"],
                   rate["plain_torch"], "samples/s", **paired_ratio(seg["ours_keymap"], seg["plain_torch"])),
        comparison("ours device key map vs ours (GPU tables)", rate["ours_keymap"], rate["ours"], "samples/s",
                   **paired_ratio(seg["ours_keymap"], seg["ours"])),
        comparison(f"ours device key map, GPU cache {s.cache_fraction:.0%} vs store on host",
                   rate["ours_keymap_cache"], rate["ours_host"], "samples/s",
                   **paired_ratio(seg["ours_keymap_cache"], seg["ours_host"])),
    ]
    if "torchrec" in rate:
        comparisons.append(comparison("ours (GPU tables) vs torchrec DMP fused", rate["ours"], rate["torchrec"],
                                      "samples/s", **paired_ratio(seg["ours"], seg["torchrec"])))
    auc = {name: d["eval"].get("auc", float("nan")) for name, d in details.items() if "eval" in d}
    comparisons.append(comparison(
        "AUC ours vs plain PyTorch", auc["ours"], auc["plain_torch"], "AUC",
        auc=auc, auc_difference=auc["ours"] - auc["plain_torch"],
        oracle_auc=oracle.get("eval", {}).get("auc"),
    ))

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    notes = [f"device: {gpu or device}"]
    notes += [f"  {name:<12} {d['samples_per_s']:>12,.0f} samples/s  segments median "
              f"{d['median_samples_per_s']:,.0f} ({d['min_max_samples_per_s'][0]:,.0f}-"
              f"{d['min_max_samples_per_s'][1]:,.0f})" + (f"  AUC {auc[name]:.4f}" if name in auc else "")
              for name, d in details.items() if "samples_per_s" in d]
    for name in OURS:
        d = details[name]
        notes.append(f"  {name:<12} device rows {d['device_rows']:,} ({d['device_rows_fraction_of_capacity']:.0%} "
                     f"of capacity); hit rate: store {_pct(d['store_hit_rate'])}, device cache "
                     f"{_pct(d['device_cache_hit_rate'])}")
    notes += [f"  {name}: skipped: {why}" for name, why in skipped.items() if why]
    return {
        "comparisons": comparisons,
        "notes": notes,
        "details": details,
        "settings": {
            **dataclasses.asdict(s),
            "device": str(device),
            "gpu": gpu,
            "steps": s.steps,
            "warmup_steps": s.warmup_steps,
            "timed_steps": s.timed_steps,
            "samples_trained": s.steps * s.batch_size,
            "data": str(root),
            "train_rows": train_rows,
            **train.job_settings(job),
            "timing": "each side: warm-up, then timed segments in turns (rotating order), "
                      "synchronized at both ends; ours in 3 spawned processes paused in their batch fetch",
            "plain_torch_input": "our reader (same batches), .to(device), keys folded by torch.remainder "
                                 "per feature, timed",
            "skipped": {k: v for k, v in skipped.items() if v},
        },
        "versions": _versions(),
        "seconds_per_part": seconds,
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f} %"


def _versions() -> dict:
    import torch

    out = versions()
    out["cuda"] = torch.version.cuda
    return out
