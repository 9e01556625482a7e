"""``recsys bench step``: the sparse side of a GPU training step, measured on the CPU.

On a GPU the step is bound by the host: by its per-key work and by the host syncs its ops
force, not by the device's arithmetic. Neither needs a GPU to be seen, so this bench counts
and times them on the CPU, for a step from the batch's ``KeyedJaggedTensor`` to the rows'
update (lookup → pooled → backward of a trivial loss → push and apply; the dense model and
its optimizer are not part of it):

- ``OpCounter``, a ``TorchDispatchMode``, records every aten op of a region by name and
  sorts it into (a) **sync-forcing** ops, which on CUDA make the host wait for the device:
  ``_local_scalar_dense`` (``item``), ``equal``/``allclose`` and every other op tagged
  ``data_dependent_output``, ``nonzero``, the ``unique`` family, ``masked_select``, indexing
  (``index``, ``index_put_``) with a boolean index, ``repeat_interleave`` without
  ``output_size`` and every other op tagged ``dynamic_output_shape``, and a copy from a
  non-CPU tensor to the CPU; (b) **view** ops (metadata only: views, ``detach``,
  ``alias``, ``lift_fresh``...); (c) **compute** ops, the rest, each a kernel launch on
  a GPU. On the CPU device a device-to-host copy cannot be seen as such, so it also counts
  the tensors that leave for numpy or Python (``Tensor.numpy``, ``tolist``, and
  ``__array__`` through ``numpy``) and the arrays that enter torch
  (``torch.from_numpy``, ``torch.as_tensor``): on a GPU each of the first is a sync when
  its tensor lives on the device, each of the second an upload. It also times the region
  and the ops inside it: the rest, wall time outside any op, is the host's own work
  (Python, numpy, numba), which on a GPU the device cannot hide.
- ``meta_time`` runs the same step on ``torch.device("meta")``, where ops allocate no memory
  and compute nothing: its time per step is the host's cost with the device's work taken
  out, the estimate of a launch-bound GPU step. It runs only when every shape is static; a
  step with an op whose output depends on the data (found by the counter on the first
  step, or an op that refuses meta tensors) is reported as not measurable that way. Meta
  kernels are slow to dispatch on some torch versions (slower than the CPU device's on small
  inputs), so meta's time is an upper bound of the host's share.
- the **dispatch floor** runs each arm's same code, tables and features on the CPU device with
  the device work made small (``floor_batch`` rows a step, at most ``floor_capacity`` rows a
  table, so every table evicts): what remains is the host's Python, dispatch and key work per
  step, the tighter estimate of a launch-bound GPU step's host time (its tiny kernels
  included, so still an upper bound of the host's share); one intra-op thread.

Arms (each with the job's schema, and with every table doubled: 2 × T tables and features,
each feature's ids repeated under its copy's name, to show how ops grow with tables):

(1) **whole-device**: today's GPU tier on device "cpu": the one-process
    ``ShardedEmbeddingStore`` with ``store.device.memory_gb`` holding every table whole
    (``DeviceTable`` rows in one ``DeviceArena``), not threaded. Pooling is the GPU path's
    ``pool_torch`` on the gathered rows (on the CPU device ``Lookup.pooled`` would run the
    numba kernel instead); the push's row gradients round-trip numpy once on the CPU device,
    which on a GPU they do not.
(2) **device key map**: ``recsys.store.device.keymap.DeviceSparse`` when it can be imported
    (the arm is skipped with a line saying so when it cannot): keys and lengths moved to the
    device, ``forward`` → trivial loss → ``backward`` → ``update``.

(3) **cached device key map**: ``recsys.store.device.cached.DeviceCachedSparse`` with a
    cache of 10 % of each table's capacity (``CACHE_SHARE``; at least the most distinct ids
    a batch brings to the table, so no step is refused) in front of host tables of the rest:
    the step of (2) after the cache's host work (the misses read back, the host's rows of
    them uploaded, the demoted rows taken by the host). Its ``to_host`` counts the hit flags'
    read (the one that waits for the device on a GPU) and the demoted rows' arrays (copied
    asynchronously there); ``from_host`` the keys asked about and the host's rows. Not run
    on meta: every step reads the device.

Batches: the job's reader over real Parquet (the ``small`` preset's columns at a reduced row
count, generated under ``bench-out/data`` when ``--data`` is not given), so the keys are the
job's hashed ids; all batches are read before any step. Each arm runs ``warmup`` steps,
then ``steps`` steps counted (one pass under the counter) and ``steps`` timed without it;
on meta the same. No assertions on timings.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import math
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "OpCounts", "MetaTiming", "meta_time", "measure", "is_sync_forcing", "VIEW_OPS"]

aten = torch.ops.aten

SYNC_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_static_dynamic", "argwhere", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "unique_dim_consecutive", "masked_select", "equal", "allclose", "is_nonzero", "bincount",
})
"""aten ops (by packet name) that make a CUDA host wait for the device, whatever their
arguments; more are found by their tags (``is_sync_forcing``)."""

VIEW_OPS = frozenset({
    "view", "_unsafe_view", "t", "expand", "select", "slice", "alias", "detach", "as_strided", "unsqueeze",
    "squeeze", "permute", "transpose", "reshape", "_reshape_alias", "view_as", "unfold", "narrow", "split",
    "split_with_sizes", "chunk", "unbind", "diagonal", "movedim", "expand_as", "lift_fresh", "real", "imag",
    "_neg_view", "_conj", "resolve_conj", "resolve_neg", "numpy_T", "prim_layout", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_has_same_storage_numel",
})
"""aten ops that change metadata only (no kernel on any device)."""

_STATIC_INDEX = frozenset({"index", "_index_put_impl_", "index_put", "index_put_"})


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


def is_sync_forcing(func, args, kwargs) -> bool:
    """Whether aten op ``func`` with these arguments makes a CUDA host wait for the device."""
    name = func.overloadpacket.__name__
    if name in _STATIC_INDEX:  # tagged dynamic for its boolean form only
        return _has_bool_index(args)
    if name == "repeat_interleave":  # its output size is a sum of the repeats unless given
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if name in ("_to_copy", "copy_", "to"):  # a device-to-host copy
        src = args[1] if name == "copy_" else args[0]
        dst_cpu = (args[0].device.type == "cpu") if name == "copy_" else (
            torch.device(kwargs.get("device") or src.device).type == "cpu")
        return isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta") and dst_cpu
    if name in SYNC_OPS:
        return True
    tags = func.tags
    return torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags


@dataclasses.dataclass
class OpCounts:
    """What an ``OpCounter`` recorded: aten ops by name (``str(func)``, e.g. ``aten.add.Tensor``)
    in their class, tensors to and from numpy by call, and seconds."""

    compute: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    view: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    sync: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    to_host: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Tensors that left for numpy or Python: ``Tensor.numpy``, ``Tensor.tolist``."""
    from_host: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Host arrays made tensors: ``torch.from_numpy``, ``torch.as_tensor``."""
    uploads: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """``Tensor.to(device)`` of such a tensor: a copy to the device on a GPU (one that waits
    for the stream unless ``non_blocking`` from pinned memory; on the CPU device no call
    shows which)."""
    op_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Seconds inside each op (``time_ops``): on the CPU device, where the device's work goes."""
    wall_s: float = 0.0
    in_ops_s: float = 0.0

    @property
    def ops(self) -> collections.Counter:
        return self.compute + self.view + self.sync

    def per_step(self, steps: int) -> dict:
        """Return the counts per step (each count over ``steps``) and the seconds per step."""
        def each(c: collections.Counter) -> dict:
            return {k: round(v / steps, 3) for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))}

        total = lambda c: round(sum(c.values()) / steps, 3)  # noqa: E731
        return {
            "ops": total(self.ops), "compute": total(self.compute), "view": total(self.view),
            "sync_forcing": total(self.sync), "to_host": total(self.to_host), "from_host": total(self.from_host),
            "uploads": total(self.uploads), "sync_ops": each(self.sync), "to_host_calls": each(self.to_host), "from_host_calls": each(self.from_host),
            "upload_calls": each(self.uploads),
            "compute_ops": each(self.compute), "view_ops": each(self.view),
            "counted_wall_ms": round(1e3 * self.wall_s / steps, 3),
            "in_ops_ms": round(1e3 * self.in_ops_s / steps, 3),
            "op_ms": {k: round(1e3 * v / steps, 3) for k, v in self.op_s.most_common(8)},
        }


class OpCounter(TorchDispatchMode):
    """Count the aten ops of a ``with`` region by class (module doc), the tensors crossing to
    and from numpy (by call and call site), the host arrays' tensors moved with ``.to(device)``
    (``uploads``), and the region's seconds inside and outside ops (``counts``).

    Only the thread that entered it is counted (dispatch modes are thread-local; a CPU
    backward runs on the caller's thread). ``time_ops=False`` skips the per-op clock."""

    def __init__(self, time_ops: bool = True) -> None:
        super().__init__()
        self.counts = OpCounts()
        self.time_ops = time_ops
        self._saved: list = []
        self._t0 = 0.0
        self._from_host: dict[int, weakref.ref] = {}  # id → the tensors made from host arrays

    def __enter__(self):
        counts, made = self.counts, self._from_host

        def leaving(fn, label):
            def wrapped(self_, *args, **kwargs):
                counts.to_host[f"{label} @ {_site()}"] += 1
                return fn(self_, *args, **kwargs)
            return wrapped

        def entering(fn, label):
            def wrapped(data, *args, **kwargs):
                out = fn(data, *args, **kwargs)
                if not isinstance(data, torch.Tensor):
                    counts.from_host[f"{label} @ {_site()}"] += 1
                    if isinstance(out, torch.Tensor) and out.device.type == "cpu":
                        made[id(out)] = weakref.ref(out)
                return out
            return wrapped

        def moving(fn):
            def wrapped(self_, *args, **kwargs):
                ref = made.get(id(self_))
                if ref is not None and ref() is self_ and _device_target(args, kwargs):
                    counts.uploads[f"Tensor.to @ {_site()}"] += 1
                return fn(self_, *args, **kwargs)
            return wrapped

        patches = [(torch.Tensor, "numpy", leaving(torch.Tensor.numpy, "Tensor.numpy")),
                   (torch.Tensor, "tolist", leaving(torch.Tensor.tolist, "Tensor.tolist")),
                   (torch.Tensor, "to", moving(torch.Tensor.to)),
                   (torch, "from_numpy", entering(torch.from_numpy, "torch.from_numpy")),
                   (torch, "as_tensor", entering(torch.as_tensor, "torch.as_tensor"))]
        for owner, name, fn in patches:
            self._saved.append((owner, name, owner.__dict__.get(name, _ABSENT)))
            setattr(owner, name, fn)
        self._t0 = time.perf_counter()
        return super().__enter__()

    def __exit__(self, *exc):
        self.counts.wall_s += time.perf_counter() - self._t0
        out = super().__exit__(*exc)
        for owner, name, own in reversed(self._saved):
            if own is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._saved.clear()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if is_sync_forcing(func, args, kwargs):
            self.counts.sync[name] += 1
        elif func.overloadpacket.__name__ in VIEW_OPS:
            self.counts.view[name] += 1
        else:
            self.counts.compute[name] += 1
        if not self.time_ops:
            return func(*args, **kwargs)
        t = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            t = time.perf_counter() - t
            self.counts.in_ops_s += t
            self.counts.op_s[name] += t


def _site() -> str:
    """Return the ``module.function`` outside torch and this module that made the current call."""
    f = sys._getframe(2)
    while f is not None and (f.f_globals.get("__name__", "").startswith("torch") or f.f_globals.get("__name__") == __name__):
        f = f.f_back
    return "?" if f is None else f"{f.f_globals.get('__name__', '?')}.{f.f_code.co_name}"


def _device_target(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names a device."""
    if "device" in kwargs:
        return True
    return bool(args) and isinstance(args[0], (torch.device, str, int)) and not isinstance(args[0], bool)


_ABSENT = object()


# --------------------------------------------------------------------------- the meta timer


@dataclasses.dataclass
class MetaTiming:
    """``meta_time``'s answer: the host seconds per step on meta, or why there are none."""

    ran: bool
    host_ms_per_step: float | None = None
    per_step_ms: list[float] = dataclasses.field(default_factory=list)
    data_dependent: int = 0
    """Sync-forcing (data-dependent) ops seen before the step stopped or was refused."""
    reason: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def meta_time(make_step: Callable[[torch.device], Callable[[int], None]], steps: int, warmup: int = 1,
              first_step: int = 0) -> MetaTiming:
    """Time ``make_step(meta)``'s step (called with step numbers ``first_step ..``): ``warmup``
    steps under an ``OpCounter`` (any sync-forcing op: refused), then ``steps`` timed ones.

    A step that raises on meta (an op without a meta kernel, a tensor read on the host) is
    refused too, with the error named: its shapes are not all static."""
    meta = torch.device("meta")
    counter = OpCounter(time_ops=False)
    step = first_step
    try:
        fn = make_step(meta)
        with counter:
            for _ in range(max(1, warmup)):
                fn(step)
                step += 1
    except (NotImplementedError, RuntimeError, TypeError, ValueError) as exc:
        n = sum(counter.counts.sync.values())
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return MetaTiming(False, data_dependent=n,
                          reason=f"not launch-bound-measurable: stopped on meta ({type(exc).__name__}: {first})")
    n = sum(counter.counts.sync.values())
    if n:
        names = ", ".join(sorted(counter.counts.sync))
        return MetaTiming(False, data_dependent=n,
                          reason=f"not launch-bound-measurable: {n} data-dependent ops ({names})")
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn(step)
        times.append(time.perf_counter() - t)
        step += 1
    return MetaTiming(True, host_ms_per_step=round(1e3 * statistics.median(times), 3),
                      per_step_ms=[round(1e3 * t, 3) for t in times])


# --------------------------------------------------------------------------- the arms


ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "synthetic_small.toml"
KEYMAP_MODULE = "recsys.store.device.keymap"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sizes of one run (``FULL``, ``QUICK``; tests pass tiny ones)."""

    batch_size: int = 16384
    """Rows per step: the GPU bench's batch (``recsys.bench.train_gpu``)."""
    steps: int = 20
    """Steps counted, and as many timed (on the CPU device and on meta each)."""
    warmup: int = 5
    """Untimed steps first (numba compiles, first inserts)."""
    job: str = str(JOB)
    data_rows: int = 800_000
    """Train rows of the generated set (when neither ``--data`` nor the job's data exists):
    more than the run's batches take, so no step sees a batch again (a repeated batch brings
    no new keys, and fewer ops)."""
    doubled: bool = True
    """Also run every arm with every table doubled."""
    device_memory_gb: float = 64.0
    """Arm (1)'s ``store.device.memory_gb``: a cap, not an allocation; must hold every table."""
    floor_batch: int = 8
    """The dispatch floor's rows per step (0: no floor run)."""
    floor_capacity: int = 256
    """The dispatch floor's rows per table (at most: a smaller table keeps its own)."""

    @property
    def batches(self) -> int:
        return self.warmup + 2 * self.steps


FULL = Settings()
QUICK = Settings(batch_size=1024, steps=4, warmup=2, data_rows=40_000)


def _preset(rows: int):
    from recsys.io.synth import Preset

    return Preset(name=f"bench-step-{rows}", train_rows=rows, eval_rows=max(1000, rows // 20),
                  rows_per_file=max(1000, rows // 4), row_group_size=max(512, min(65_536, rows // 8)))


def ensure_data(s: Settings, data: Path | None) -> Path:
    """Return the data set's directory: ``data``, the job's own (if it exists), or one of the
    ``small`` preset's columns with ``s.data_rows`` rows, generated under ``bench-out/data``."""
    from recsys.config import load_job

    if data is not None:
        if not (Path(data) / "train").is_dir():
            raise FileNotFoundError(f"{data}: expected a data set directory with train/ inside")
        return Path(data)
    paths = [Path(p) for p in load_job(s.job).data.train.paths]
    if paths and all(p.exists() for p in paths) and len(paths) == 1 and paths[0].name == "train":
        return paths[0].parent
    target = ROOT / "bench-out" / "data" / f"step-{s.data_rows}"
    if not (target / "oracle.json").exists():
        from recsys.io import synth

        print(f"generating {target} ...", flush=True)
        synth.generate(_preset(s.data_rows), target)
    return target


def load_step_job(root: Path, s: Settings, *extra: str):
    from recsys.config import load_job

    return load_job(s.job, [f"data.train.paths=['{root / 'train'}']", f"data.train.batch_size={s.batch_size}",
                            "data.train.num_workers=0", *extra])


def read_batches(job, n: int) -> list:
    """Return the sparse ``KeyedJaggedTensor`` of ``n`` full batches from the job's reader
    (its epochs repeated if it has fewer)."""
    from recsys.io.reader import ParquetReader

    out = []
    while len(out) < n:
        reader = ParquetReader(job.data.train, job.schema)
        before = len(out)
        for batch in reader:
            if batch.size == job.data.train.batch_size:
                out.append(batch.sparse)
            if len(out) == n:
                break
        close = getattr(reader, "close", None)
        if close is not None:
            close()
        if len(out) == before:
            raise ValueError(f"the data holds no full batch of {job.data.train.batch_size} rows")
    return out


def doubled(schema):
    """Return ``schema`` with every table and feature twice (the copies named ``*_x2``)."""
    tables = dict(schema.tables)
    sparse = list(schema.sparse)
    for name, spec in schema.tables.items():
        tables[f"{name}_x2"] = spec
    for f in schema.sparse:
        sparse.append(dataclasses.replace(f, name=f"{f.name}_x2", table=f"{f.table}_x2"))
    return schema.replace(tables=tables, sparse=sparse)


def doubled_kjt(kjt):
    """Return ``kjt`` with each feature's ids repeated under its copy's name (``doubled``)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    w = kjt.weights_or_none()
    return KeyedJaggedTensor(keys=list(kjt.keys()) + [f"{k}_x2" for k in kjt.keys()],
                             values=torch.cat([kjt.values(), kjt.values()]),
                             lengths=torch.cat([kjt.lengths(), kjt.lengths()]),
                             weights=None if w is None else torch.cat([w, w]))


def whole_device_step(schema, cfg, batches: list) -> Callable[[torch.device], tuple[Callable[[int], None], Callable]]:
    """Arm (1): return ``make(device) -> (step, close)``: a one-process store with every table
    whole on ``device`` (``DeviceTable``s in one arena), and its step from the batch's KJT
    to the rows' update (module doc)."""
    from recsys.store.device.table import DeviceTable
    from recsys.store.sharded.store import ShardedEmbeddingStore
    from recsys.store.tables.pooling import pool_torch

    def make(device: torch.device):
        store = ShardedEmbeddingStore(schema, cfg, device=device, threaded=False)
        kinds = {type(t).__name__ for t in store.tables.values()}
        if kinds != {DeviceTable.__name__} or store._arena is None:
            store.close()
            raise ValueError(f"arm (1) needs every table whole on the device, found {sorted(kinds)}; "
                             "raise Settings.device_memory_gb")

        def step(i: int) -> None:
            lk = store.lookup(batches[i % len(batches)], i)
            pooled = pool_torch(lk.rows_all, lk.single_idx, lk.single_cols, lk.multi_values, lk.multi_offsets,
                                lk.multi_weights, lk.multi_cols)  # the GPU path's pooling (Lookup.pooled off CPU)
            pooled.sum().backward()  # a trivial loss: the dense model is not part of the step
            store.push(lk)
            store.flush(through_step=i)  # the push applied inside the step

        return step, store.close

    return make


def keymap_available() -> str | None:
    """Return None when ``DeviceSparse`` can be imported, else the reason it cannot."""
    try:
        module = importlib.import_module(KEYMAP_MODULE)
    except ImportError as exc:
        return f"{KEYMAP_MODULE} cannot be imported ({exc})"
    if not hasattr(module, "DeviceSparse"):
        return f"{KEYMAP_MODULE} has no DeviceSparse"
    return None


def keymap_step(schema, cfg, batches: list) -> Callable[[torch.device], tuple[Callable[[int], None], Callable]]:
    """Arm (2): return ``make(device) -> (step, close)`` over ``DeviceSparse``: the batch's
    keys and lengths moved to the device, ``forward``, a trivial loss, ``backward``, ``update``;
    ``close`` reads ``counters()`` and raises if the device counted an error (a key without a
    free way, a batch over a table's capacity)."""
    DeviceSparse = importlib.import_module(KEYMAP_MODULE).DeviceSparse
    features = [(f.name, f.table, f.pooling) for f in schema.sparse]

    def make(device: torch.device):
        sp = DeviceSparse(dict(schema.tables), features, cfg, device)
        if device.type == "meta" and hasattr(sp, "_order_valid"):
            # the one host read of a run: the LRU order sorted on the host when a table may
            # first be full (``DeviceSparse._may_evict``). On meta no value is ever read, so
            # the order is taken as built and every step runs the eviction ops, as the CPU
            # device's steps do once the small tables are full (the steady state timed)
            sp._order_valid = True

        def step(i: int) -> None:
            kjt = batches[i % len(batches)]
            w = kjt.weights_or_none()
            keys, lengths = kjt.values().to(device), kjt.lengths().to(device)
            pooled = sp.forward(keys, lengths, i, weights=None if w is None else w.to(device))
            pooled.sum().backward()
            sp.update(i)

        def close() -> None:
            # the arm's figures stand only if the index is sound: read what the device counted
            # (not on meta, where nothing is computed)
            try:
                if device.type != "meta":
                    try:
                        sp.counters()
                    except Exception as exc:
                        raise RuntimeError(f"keymap arm: DeviceSparse reported an error after the arm's steps, "
                                           f"so its figures are not reported: {exc}") from exc
            finally:
                getattr(sp, "close", lambda: None)()

        return step, close

    return make


CACHE_SHARE = 0.1
"""Arm (3)'s cache: this share of each table's capacity (at least one batch's distinct ids)."""


def cache_rows_for(schema, batches: list, share: float = CACHE_SHARE) -> dict[str, int]:
    """Return each table's cache rows for arm (3): ``share`` of its capacity, at least the most
    distinct ids one of ``batches`` brings to it."""
    import numpy as np

    most = dict.fromkeys(schema.tables, 1)
    for kjt in batches:
        v, offs = kjt.values().numpy(), kjt.offset_per_key()
        per: dict[str, list] = {}
        for f, spec in enumerate(schema.sparse):
            per.setdefault(spec.table, []).append(v[offs[f]:offs[f + 1]])
        for t, parts in per.items():
            most[t] = max(most[t], int(np.unique(np.concatenate(parts)).shape[0]))
    return {n: max(most[n], math.ceil(share * spec.capacity)) for n, spec in schema.tables.items()}


def cached_step(schema, cfg, batches: list) -> Callable[[torch.device], tuple[Callable[[int], None], Callable]]:
    """Arm (3): return ``make(device) -> (step, close)`` over ``DeviceCachedSparse`` with
    ``cache_rows_for``'s cache: the step of arm (2), the cache's host work before the
    forward; ``close`` reads ``counters()`` and raises on an error the device counted."""
    from recsys.store.device.cached import DeviceCachedSparse

    features = [(f.name, f.table, f.pooling) for f in schema.sparse]
    rows = cache_rows_for(schema, batches)
    host = [(k.values().numpy(), k.lengths().numpy()) for k in batches]  # views of the host KJTs

    def make(device: torch.device):
        if device.type == "meta":
            raise ValueError("the cached arm reads the device every step: it does not run on meta")
        sp = DeviceCachedSparse(dict(schema.tables), features, cfg, device, cache_rows=rows)

        def step(i: int) -> None:
            kjt = batches[i % len(batches)]
            w = kjt.weights_or_none()
            keys, lengths = kjt.values().to(device), kjt.lengths().to(device)
            hk, hl = host[i % len(batches)]
            pooled = sp.forward(keys, lengths, i, weights=None if w is None else w.to(device), host_keys=hk,
                                host_lengths=hl)
            pooled.sum().backward()
            sp.update(i)

        def close() -> None:
            try:
                sp.counters()
            except Exception as exc:
                raise RuntimeError(f"cached arm: DeviceCachedSparse reported an error after the arm's steps, "
                                   f"so its figures are not reported: {exc}") from exc

        return step, close

    return make


def run_arm(make, s: Settings, meta: bool = True) -> dict:
    """Return one arm's figures after ``s.warmup`` steps: ops per step (``s.steps`` steps under
    an ``OpCounter``), the CPU time per step (median of ``s.steps`` steps without it, each
    right after a counted one) and the meta timer's (``meta_time``, after its own warm-up)."""
    step, close = make(torch.device("cpu"))
    try:
        i = 0
        for _ in range(s.warmup):
            step(i)
            i += 1
        counter, times = OpCounter(), []
        for _ in range(s.steps):  # counted and timed steps take turns: both see the same batches' phase
            with counter:
                step(i)
            t = time.perf_counter()
            step(i + 1)
            times.append(time.perf_counter() - t)
            i += 2
    finally:
        close()
    per_step = counter.counts.per_step(s.steps)
    cpu_ms = round(1e3 * statistics.median(times), 3)
    # the host's own work: the uncounted steps' mean time less the counted steps' time inside ops
    # (the counter's own overhead falls outside ops, so its region's wall time is not used)
    out = {"per_step": per_step, "cpu_ms_per_step": cpu_ms,
           "outside_ops_ms": round(max(0.0, 1e3 * statistics.fmean(times) - per_step["in_ops_ms"]), 3),
           "cpu_ms_min_max": [round(1e3 * min(times), 3), round(1e3 * max(times), 3)]}
    if meta:
        closers = []

        def on_meta(device):
            fn, done = make(device)
            closers.append(done)
            return fn

        try:
            timing = meta_time(on_meta, s.steps, warmup=s.warmup)
        finally:
            for done in closers:
                done()
        if not timing.ran and out["per_step"]["sync_forcing"]:
            n = out["per_step"]["sync_forcing"]
            timing.reason = (f"not launch-bound-measurable: {n:g} data-dependent ops per step on the CPU "
                             f"({', '.join(out['per_step']['sync_ops'])}); {timing.reason.split(': ', 1)[-1]}")
        out["meta"] = timing.as_dict()
    return out


def measure(quick: bool, data: Path | None = None, settings: Settings | None = None, config: str | None = None,
            batch_size: int | None = None, steps: int | None = None) -> dict:
    """Run every arm, with the job's tables and doubled; return ``recsys.bench.run``'s result."""
    from recsys import bench

    s = settings or (QUICK if quick else FULL)
    changes = {k: v for k, v in (("job", config), ("batch_size", batch_size), ("steps", steps)) if v is not None}
    s = dataclasses.replace(s, **changes)
    root = ensure_data(s, data)
    job = load_step_job(root, s, f"store.device.memory_gb={float(s.device_memory_gb)}", "store.device.cache_rows=0")
    t = time.perf_counter()
    base = read_batches(job, s.batches)
    read_s = time.perf_counter() - t
    missing = keymap_available()
    arms: dict[str, dict] = {}
    variants = [("", job.schema, base)]
    if s.doubled:
        variants.append(("doubled", doubled(job.schema), [doubled_kjt(k) for k in base]))
    for suffix, schema, batches in variants:
        name = "whole_device" + (f"_{suffix}" if suffix else "")
        arms[name] = {"tables": len(schema.tables), "features": len(schema.sparse),
                      **run_arm(whole_device_step(schema, job.store, batches), s)}
        name = "keymap" + (f"_{suffix}" if suffix else "")
        if missing is None:
            arms[name] = {"tables": len(schema.tables), "features": len(schema.sparse),
                          **run_arm(keymap_step(schema, job.store, batches), s)}
        else:
            arms[name] = {"skipped": missing}
        name = "keymap_cached" + (f"_{suffix}" if suffix else "")
        if missing is None:
            arms[name] = {"tables": len(schema.tables), "features": len(schema.sparse),
                          **run_arm(cached_step(schema, job.store, batches), s, meta=False)}
        else:
            arms[name] = {"skipped": missing}
    floor = dispatch_floor(root, s, missing is None) if s.floor_batch else {}
    comparisons = []
    if "keymap" in floor and "whole_device" in floor:
        comparisons.append(bench.comparison(
            f"dispatch-floor steps/s (B {s.floor_batch}), key map vs whole-device",
            1e3 / floor["keymap"]["cpu_ms_per_step"], 1e3 / floor["whole_device"]["cpu_ms_per_step"], "steps/s"))
    for suffix in [v[0] for v in variants]:
        a, b = (f"{n}{'_' + suffix if suffix else ''}" for n in ("keymap", "whole_device"))
        if "skipped" in arms[a]:
            continue
        tag = f" ({suffix})" if suffix else ""
        comparisons.append(bench.comparison(f"CPU steps/s, key map vs whole-device{tag}",
                                            1e3 / arms[a]["cpu_ms_per_step"], 1e3 / arms[b]["cpu_ms_per_step"],
                                            "steps/s"))
        c = f"keymap_cached{'_' + suffix if suffix else ''}"
        comparisons.append(bench.comparison(f"CPU steps/s, cached key map (10 % cache) vs key map{tag}",
                                            1e3 / arms[c]["cpu_ms_per_step"], 1e3 / arms[a]["cpu_ms_per_step"],
                                            "steps/s"))
        ma, mb = arms[a].get("meta", {}), arms[b].get("meta", {})
        if ma.get("ran") and mb.get("ran"):
            comparisons.append(bench.comparison(f"meta (host) steps/s, key map vs whole-device{tag}",
                                                1e3 / ma["host_ms_per_step"], 1e3 / mb["host_ms_per_step"],
                                                "steps/s"))
    return {"comparisons": comparisons, "arms": arms, "floor": floor, "notes": report(arms) + report_floor(floor, s),
            "settings": {**dataclasses.asdict(s), "data": str(root), "read_s": round(read_s, 3),
                         "torch_threads": torch.get_num_threads(), "versions": bench.versions()}}


def dispatch_floor(root: Path, s: Settings, with_keymap: bool) -> dict:
    """Return each arm's figures at the dispatch floor (module doc): ``s.floor_batch`` rows a
    step from the same data, every table at most ``s.floor_capacity`` rows, no meta run."""
    fs = dataclasses.replace(s, batch_size=s.floor_batch)
    job = load_step_job(root, fs, f"store.device.memory_gb={float(s.device_memory_gb)}", "store.device.cache_rows=0")
    schema = job.schema.replace(tables={name: dataclasses.replace(spec, capacity=min(spec.capacity, s.floor_capacity))
                                        for name, spec in job.schema.tables.items()})
    batches = read_batches(job, fs.batches)
    # one intra-op thread: a launch-bound step's host work is one thread's dispatch, and at
    # these sizes a second thread only adds its wake-ups (on a shared host, its waits)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {"whole_device": {"tables": len(schema.tables),
                                **run_arm(whole_device_step(schema, job.store, batches), fs, meta=False)}}
        if with_keymap:
            out["keymap"] = {"tables": len(schema.tables),
                             **run_arm(keymap_step(schema, job.store, batches), fs, meta=False)}
    finally:
        torch.set_num_threads(threads)
    return out


def report_floor(floor: dict, s: Settings) -> list[str]:
    """Return the dispatch floor's lines (``dispatch_floor``)."""
    lines = []
    for name, arm in floor.items():
        p = arm["per_step"]
        lines.append(f"dispatch floor, {name} (B {s.floor_batch}, tables <= {s.floor_capacity} rows): host ms/step "
                     f"{arm['cpu_ms_per_step']:.3f} (min {arm['cpu_ms_min_max'][0]:.3f}; outside torch ops "
                     f"{arm['outside_ops_ms']:.3f}); ops/step {p['ops']:g}, sync-forcing {p['sync_forcing']:g}")
    return lines


def report(arms: dict) -> list[str]:
    """Return the lines that show each arm's figures (printed after the comparisons)."""
    lines = []
    for name, arm in arms.items():
        if "skipped" in arm:
            lines.append(f"{name}: skipped: {arm['skipped']}")
            continue
        p = arm["per_step"]
        meta = arm.get("meta", {})
        host = (f"meta {meta['host_ms_per_step']:.3f} ms" if meta.get("ran") else meta.get("reason", "meta not run"))
        lines.append(f"{name} ({arm['tables']} tables): ops/step {p['ops']:g} = compute {p['compute']:g} + view "
                     f"{p['view']:g} + sync-forcing {p['sync_forcing']:g}; to numpy {p['to_host']:g}, "
                     f"from numpy {p['from_host']:g}; host ms/step: CPU {arm['cpu_ms_per_step']:.3f} "
                     f"(outside torch ops {arm['outside_ops_ms']:.3f}); uploads {p['uploads']:g}")
        if p["op_ms"]:
            lines.append("  most time inside (CPU device, ms/step): "
                         + ", ".join(f"{k} {v:.1f}" for k, v in list(p["op_ms"].items())[:4]))
        if p["sync_ops"]:
            lines.append(f"  sync-forcing per step: " + ", ".join(f"{k} {v:g}" for k, v in p["sync_ops"].items()))
        for kind in ("to_host_calls", "upload_calls"):
            if p[kind]:
                lines.append(f"  {kind.split('_c')[0]} per step: " + ", ".join(f"{k} {v:g}" for k, v in p[kind].items()))
        lines.append(f"  on meta: {host}")
    return lines
