"""``recsys bench store``: the embedding store against the fused kernel, the payload, MIN and itself.

Four comparisons, one run (settings and versions go to the JSON):

1. **Training step** on Zipf(1.05) batches (26 single-hot features, one table each, dim
   64, batch 4096): ``ShardedEmbeddingStore`` in one process (row-wise Adagrad, capacity
   above the trace's distinct keys, so nothing is evicted) vs fbgemm's fused CPU kernel,
   ``SplitTableBatchedEmbeddingBagsCodegen`` with ``EXACT_ROWWISE_ADAGRAD`` on
   ``EmbeddingLocation.HOST`` / ``ComputeDevice.CPU`` — the module torchrec's
   ``BatchedFusedEmbeddingBag`` builds on CPU — with tables pre-sized to the trace's
   distinct ids and the keys remapped to dense rows ahead of time (the baseline pays no
   hashing, no key map, no insertion). Both sides do: sum pooling -> ``loss = (pooled *
   W).sum() / B`` with a fixed ``W`` -> backward -> optimizer update (ours: ``push`` and,
   at the end of a timed run, ``flush``). Both start from the same rows (the baseline's
   weights are our initial vectors of the same keys), so their losses must agree step by
   step: the JSON records the largest difference. Id universes are the Criteo Kaggle
   cardinalities (3 .. 10.1 M ids per table; capped in ``--quick``), ids drawn from a
   bounded Zipf(1.05) (``recsys.io.zipf``, the synthetic data's law) and hashed to 64-bit
   keys. Samples/s = steps x batch / seconds.
2. **Memory**: bytes per stored row of one ``EmbeddingTable`` filled to capacity (dim 64,
   row-wise Adagrad), counted as the ``nbytes`` of every array the table and its key map
   allocate (weights, optimizer state, buckets, slot arrays, eviction pool, sketch), vs
   the payload ``dim x 4 + 4`` (float32 row + one float of row-wise state); cross-checked
   with the RSS growth of building and filling the table (in a fresh process, so freed
   heap pages of earlier parts cannot hide the growth). Target <= 1.5x.
3. **LRU vs Belady's MIN**: misses of our real ``EmbeddingTable`` (KeyMap LRU eviction)
   with capacity = 10 % of the trace's distinct keys, fed a Zipf(1.05) trace in batches
   of 4096 ids, vs the optimal offline policy on the same request sequence (each batch's
   distinct keys, as the store sends them; a repeat inside a batch is a hit for both).
   Miss rate = misses / ids in the trace (compulsory misses included for both).
4. **Two ranks vs one**, same total work: 2 spawned gloo processes with half the batch
   each (1 torch thread each) vs 1 process with the whole batch (2 torch threads), so both
   use 2 threads. Both configurations live in the same two processes and alternate round
   by round: the 1-rank store belongs to a process group of rank 0 alone while rank 1
   waits at a barrier (its CPU time during those phases is recorded), so spawning costs
   nothing per round and a noisy neighbour hurts both alike. The losses of the two must
   agree (the store's 2 ranks == 1 rank invariant); the JSON records the difference.

Timed runs alternate (ours first in even rounds, the baseline first in odd ones) and each
side keeps its best run (medians are in the JSON too); every round uses fresh batches of
the same stream for both sides, so ours pays its steady-state insertions, as in training.
Threads: comparison 1 runs both sides with 2 threads (``threads``): ``torch.set_num_threads(2)``
for both, and ``store.host.threads = 2`` for ours (its per-table work on the store's worker plus
one helper; each numba kernel is single-threaded). In comparison 4 the 1-rank store gets 2
store threads and each of the 2 ranks' stores 1. Unless the caller set it, the run
sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads (see ``recsys.bench.passive_omp``): on 2 shared
cores, spinning OpenMP workers made 2-thread runs 5-20x slower and wildly noisy.
No assertions on timings.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import time

import numpy as np
from numba import njit

from recsys.bench import comparison, paired_ratio, with_passive_omp, quiet_fbgemm, versions
from recsys.io.zipf import zipf_ranks

# Criteo Kaggle (Display Advertising Challenge) categorical cardinalities, C1..C26.
CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sizes of one benchmark run (``FULL``, ``QUICK``; tests pass tiny ones)."""

    batch: int = 4096
    dim: int = 64
    universes: tuple[int, ...] = CRITEO_CARDINALITIES  # one table (and feature) per entry
    zipf_a: float = 1.05
    steps: int = 10  # steps per timed run
    warmup_rounds: int = 2  # untimed rounds (fresh batches) before the timed ones
    repeats: int = 20  # timed rounds: paired ratios per round (median, min-max) and best-of
    threads: int = 2  # torch threads of both sides in comparison 1 (4 uses 2 vs 1 + 1)
    store_threads: int | None = None  # ours' store.host.threads in comparison 1 (None: ``threads``)
    lr: float = 0.01
    capacity_headroom: float = 1.25  # ours: capacity = headroom x distinct keys (+64)
    mem_capacity: int = 1_000_000
    lru_ids: int = 4_000_000
    lru_universe: int = 10_000_000
    lru_batch: int = 4096
    lru_capacity_fraction: float = 0.10
    dist_steps: int = 5
    dist_warmup_rounds: int = 2
    dist_repeats: int = 10
    dist_timeout_s: float = 600.0
    seed: int = 0

    @property
    def tables(self) -> int:
        return len(self.universes)


FULL = Settings()
QUICK = Settings(
    universes=tuple(min(u, 200_000) for u in CRITEO_CARDINALITIES),
    steps=5, warmup_rounds=1, repeats=6, mem_capacity=200_000, lru_ids=1_000_000,
    lru_universe=2_000_000, dist_steps=3, dist_warmup_rounds=1, dist_repeats=3,
)


# --------------------------------------------------------------------------- the trace


def _table_name(t: int) -> str:
    return f"t{t:02d}"


def make_trace(s: Settings, n_batches: int) -> np.ndarray:
    """Return the 64-bit keys [n_batches, T, B] of the training stream (deterministic)."""
    from recsys.features import hashing

    out = np.empty((n_batches, s.tables, s.batch), dtype=np.int64)
    for t, universe in enumerate(s.universes):
        rng = np.random.default_rng([s.seed, t])
        ranks = zipf_ranks(rng, n_batches * s.batch, universe, s.zipf_a)
        out[:, t, :] = hashing.hash_int64(ranks, _table_name(t)).reshape(n_batches, s.batch)
    return out


def _schema(s: Settings, capacities: list[int]):
    from recsys.features.schema import FeatureSpec, Schema, TableSpec

    return Schema(
        tables={_table_name(t): TableSpec(dim=s.dim, capacity=int(c)) for t, c in enumerate(capacities)},
        sparse=[FeatureSpec(name=f"f{t:02d}", table=_table_name(t)) for t in range(s.tables)],
    )


def _kjt(keys_TB: np.ndarray):
    """Return the single-hot KJT of one batch (features in table order)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    T, B = keys_TB.shape
    return KeyedJaggedTensor(
        keys=[f"f{t:02d}" for t in range(T)],
        values=torch.from_numpy(np.ascontiguousarray(keys_TB).reshape(-1)),
        lengths=torch.ones(T * B, dtype=torch.int32),
        stride=B,
        length_per_key=[B] * T,
        offset_per_key=[B * t for t in range(T + 1)],
    )


def _upstream(s: Settings):
    """Return the fixed W [1, T, D] of ``loss = (pooled * W).sum() / B``."""
    import torch

    g = torch.Generator().manual_seed(s.seed)
    return torch.randn(1, s.tables, s.dim, generator=g)


def _ours_steps(store, kjts, W, first_step: int) -> list[float]:
    """Run one training step per KJT on ``store`` (then flush); return the losses."""
    losses = []
    for i, kjt in enumerate(kjts):
        lookup = store.lookup(kjt, first_step + i)
        pooled = lookup.pooled(W.shape[1])
        loss = (pooled * W).sum() / kjt.stride()
        loss.backward()
        store.push(lookup)
        losses.append(loss.item())
    store.flush()
    return losses


# --------------------------------------------------------------------------- 1. training step


def _fbgemm():
    with quiet_fbgemm():
        import fbgemm_gpu
        from fbgemm_gpu import split_table_batched_embeddings_ops_training as tbe_mod
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
    return fbgemm_gpu, tbe_mod, EmbOptimType, EmbeddingLocation, PoolingMode, WeightDecayMode


def _measure_step(s: Settings) -> dict:
    import torch

    from recsys.store.config import HostConfig, StoreConfig
    from recsys.store.sharded.store import ShardedEmbeddingStore
    from recsys.store.tables.table import init_vectors

    _, tbe_mod, EmbOptimType, EmbeddingLocation, PoolingMode, WeightDecayMode = _fbgemm()
    torch.set_num_threads(s.threads)
    rounds = s.warmup_rounds + s.repeats
    keys = make_trace(s, rounds * s.steps)  # [N, T, B]
    T, B, D = s.tables, s.batch, s.dim
    cfg = StoreConfig(lr=s.lr, host=HostConfig(threads=s.threads if s.store_threads is None else s.store_threads))

    # baseline: keys remapped to dense rows ahead of time, tables sized to the distinct ids
    rows_idx = np.empty_like(keys)
    distinct = []
    init_rows = []
    for t in range(T):
        uniq, inv = np.unique(keys[:, t, :], return_inverse=True)
        rows_idx[:, t, :] = inv.reshape(keys.shape[0], B)
        distinct.append(int(uniq.shape[0]))
        init_rows.append(init_vectors(uniq, D, _table_name(t), cfg.seed, cfg.init_bound(D)))
    with quiet_fbgemm():
        tbe = tbe_mod.SplitTableBatchedEmbeddingBagsCodegen(
            [(n, D, EmbeddingLocation.HOST, tbe_mod.ComputeDevice.CPU) for n in distinct],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=cfg.lr,
            eps=cfg.eps,
            weight_decay=0.0,
            weight_decay_mode=WeightDecayMode.NONE,
            pooling_mode=PoolingMode.SUM,
        )
    with torch.no_grad():
        for w, init in zip(tbe.split_embedding_weights(), init_rows):
            w.copy_(torch.from_numpy(init))
    del init_rows
    base_inputs = [torch.from_numpy(np.ascontiguousarray(rows_idx[b]).reshape(-1)) for b in range(keys.shape[0])]
    del rows_idx
    base_offsets = torch.arange(T * B + 1, dtype=torch.int64)

    capacities = [int(math.ceil(n * s.capacity_headroom)) + 64 for n in distinct]
    store = ShardedEmbeddingStore(_schema(s, capacities), cfg)
    kjts = [_kjt(keys[b]) for b in range(keys.shape[0])]
    del keys
    W = _upstream(s)

    def baseline(batches: range) -> list[float]:
        losses = []
        for b in batches:
            pooled = tbe(base_inputs[b], base_offsets).view(B, T, D)
            loss = (pooled * W).sum() / B
            loss.backward()
            losses.append(loss.item())
        return losses

    best = {"ours": float("inf"), "baseline": float("inf")}
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    losses = {"ours": [], "baseline": []}
    step = 0
    for r in range(rounds):
        batches = range(r * s.steps, (r + 1) * s.steps)
        order = ("ours", "baseline") if r % 2 == 0 else ("baseline", "ours")
        for side in order:
            gc.collect()
            t0 = time.perf_counter()
            if side == "ours":
                got = _ours_steps(store, [kjts[b] for b in batches], W, step)
            else:
                got = baseline(batches)
            dt = time.perf_counter() - t0
            losses[side].extend(got)
            if r >= s.warmup_rounds:
                times[side].append(dt)
                best[side] = min(best[side], dt)
        step += s.steps
    counters = store.counters()
    ours_l, base_l = np.array(losses["ours"]), np.array(losses["baseline"])
    rate = {k: s.steps * B / v for k, v in best.items()}
    return {
        "comparison": comparison(
            "train step: store vs fbgemm TBE (pre-remapped)", rate["ours"], rate["baseline"],
            "samples/s", target_ratio=0.8, **paired_ratio(times["ours"], times["baseline"]),
        ),
        "detail": {
            "distinct_keys_per_table": distinct,
            "store_capacity_per_table": capacities,
            "seconds_per_run": times,
            "median_samples_per_s": {k: s.steps * B / float(np.median(v)) for k, v in times.items()},
            "max_abs_loss_diff": float(np.max(np.abs(ours_l - base_l))),
            "max_abs_loss": float(np.max(np.abs(base_l))),
            "store_inserts": int(sum(c["inserts"] for c in counters.values())),
            "store_evictions": int(sum(c["evictions"] for c in counters.values())),
            "store_hits": int(sum(c["hits"] for c in counters.values())),
            "store_misses": int(sum(c["misses"] for c in counters.values())),
        },
    }


# --------------------------------------------------------------------------- 2. memory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def owned_arrays(obj) -> dict[str, int]:
    """Return ``{attribute path: nbytes}`` of every numpy array ``obj`` holds, each buffer once.

    Follows attributes, dicts, lists and tuples of objects from ``recsys`` modules."""
    return {path: a.nbytes for path, a in _owned(obj).items()}


def resident_bytes(obj) -> int:
    """Return the bytes of memory the arrays ``obj`` holds (``owned_arrays``) have resident
    now: their pages the kernel backs (``mincore``), whole 4 KiB pages; an array never
    touched is not resident, however large. Two overcounts, small for the store's arrays
    (written where they are read): a page only read maps the kernel's shared zero page,
    which ``mincore`` reports as present though RSS does not count it; and arrays that
    share a page each count it whole."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = 0
    for a in _owned(obj).values():
        addr = a.__array_interface__["data"][0]
        lo = addr - addr % page
        pages = -(-(addr + a.nbytes - lo) // page)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(pages * page), vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore of an array of {a.nbytes} bytes: {os.strerror(err)}")
        total += int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * page
    return total


def _owned(obj) -> dict[str, np.ndarray]:
    """Return ``{attribute path: array}``: the outermost array of each buffer ``obj`` holds,
    once (see ``owned_arrays``)."""
    seen: set = set()
    out: dict[str, np.ndarray] = {}

    def visit(v, path: str) -> None:
        if isinstance(v, np.ndarray):
            base = v
            while isinstance(base.base, np.ndarray):
                base = base.base
            addr = base.__array_interface__["data"][0]
            if addr not in seen and base.nbytes:
                seen.add(addr)
                out[path] = base
        elif isinstance(v, dict):
            for k, x in v.items():
                visit(x, f"{path}[{k!r}]")
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                visit(x, f"{path}[{i}]")
        elif type(v).__module__.startswith("recsys") and id(v) not in seen:
            seen.add(id(v))
            attrs = getattr(v, "__dict__", None) or {
                n: getattr(v, n) for n in getattr(type(v), "__slots__", ()) if hasattr(v, n)
            }
            for k, x in attrs.items():
                visit(x, f"{path}.{k}" if path else k)

    visit(obj, "")
    return out


def _in_fresh_process(fn, *args):
    """Return ``fn(*args)`` run in a new spawned interpreter (a clean heap for RSS readings:
    in a long-lived process new arrays reuse freed heap pages and RSS barely moves)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _measure_memory(s: Settings) -> dict:
    from recsys.features import hashing
    from recsys.features.schema import TableSpec
    from recsys.store.config import StoreConfig
    from recsys.store.tables.table import EmbeddingTable

    C, D = s.mem_capacity, s.dim
    cfg = StoreConfig()
    keys = hashing.hash_int64(np.arange(C, dtype=np.int64), "mem")
    chunk = 65_536
    gc.collect()
    rss0 = _rss_bytes()
    table = EmbeddingTable("mem", TableSpec(dim=D, capacity=C), cfg)
    for i, start in enumerate(range(0, C, chunk)):
        table.lookup(keys[start : start + chunk], i)
    gc.collect()
    rss1 = _rss_bytes()
    if len(table) != C:
        raise RuntimeError(f"memory table holds {len(table)} rows, expected {C}")
    arrays = owned_arrays(table)
    total = sum(arrays.values())
    payload = D * 4 + 4
    del table
    gc.collect()

    # what admission (min_count > 1) adds, and a capacity just above a power of two (the key
    # map's buckets doubled there until 2026-11-27; they now scale with the capacity, and
    # this shows it): every array is preallocated, so no filling needed
    variants = {}
    for label, cap, mc in (("min_count=2", C, 2), ("capacity=2^k+1", (1 << max(1, (C - 1).bit_length())) + 1, 1)):
        t = EmbeddingTable("mem", TableSpec(dim=D, capacity=cap), StoreConfig(min_count=mc))
        variants[label] = {"capacity": cap, "bytes_per_row": sum(owned_arrays(t).values()) / cap}
        del t
        gc.collect()
    return {
        "comparison": comparison(
            "memory: bytes/row vs payload (lower better)", total / C, payload, "bytes/row", target_ratio=1.5,
        ),
        "detail": {
            "capacity": C,
            "payload_bytes_per_row": payload,
            "arrays_bytes": arrays,
            "arrays_bytes_per_row": {k: v / C for k, v in arrays.items()},
            "rss_growth_bytes_per_row": (rss1 - rss0) / C,
            "variants": variants,
        },
    }


# --------------------------------------------------------------------------- 3. LRU vs MIN


@njit(nogil=True, cache=True)
def _belady_kernel(seq, nxt, n_keys, capacity):
    """Return the misses of Belady's MIN (evict the farthest next use) on ``seq``.

    ``nxt[i]``: index of the next access to ``seq[i]`` (len(seq) if none). Max-heap of
    (next use, key) with lazy deletion: an entry is live iff its key is cached and the
    entry's next use is the key's current one."""
    n = seq.shape[0]
    cached = np.zeros(n_keys, dtype=np.bool_)
    cur = np.zeros(n_keys, dtype=np.int64)
    hn = np.empty(n + 1, dtype=np.int64)
    hk = np.empty(n + 1, dtype=np.int64)
    size = 0
    used = 0
    misses = 0
    for i in range(n):
        k = seq[i]
        if not cached[k]:
            misses += 1
            if used == capacity:
                while True:  # pop the max until a live entry turns up
                    top_n, top_k = hn[0], hk[0]
                    size -= 1
                    ln, lk = hn[size], hk[size]
                    j = 0
                    while True:
                        c = 2 * j + 1
                        if c >= size:
                            break
                        if c + 1 < size and hn[c + 1] > hn[c]:
                            c += 1
                        if hn[c] <= ln:
                            break
                        hn[j], hk[j] = hn[c], hk[c]
                        j = c
                    if size > 0:
                        hn[j], hk[j] = ln, lk
                    if cached[top_k] and cur[top_k] == top_n:
                        cached[top_k] = False
                        used -= 1
                        break
            cached[k] = True
            used += 1
        cur[k] = nxt[i]
        # push (nxt[i], k)
        j = size
        size += 1
        while j > 0:
            p = (j - 1) // 2
            if hn[p] >= nxt[i]:
                break
            hn[j], hk[j] = hn[p], hk[p]
            j = p
        hn[j], hk[j] = nxt[i], k
    return misses


def belady_misses(seq: np.ndarray, capacity: int) -> int:
    """Return the misses of Belady's optimal policy with ``capacity`` slots on ``seq`` (ints)."""
    seq = np.asarray(seq)
    uniq, dense = np.unique(seq, return_inverse=True)
    dense = dense.astype(np.int64).reshape(-1)
    n = dense.shape[0]
    order = np.argsort(dense, kind="stable")  # accesses grouped by key, in time order
    nxt = np.full(n, n, dtype=np.int64)
    same = dense[order[1:]] == dense[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return int(_belady_kernel(dense, nxt, uniq.shape[0], int(capacity)))


def lru_misses(batches: list[np.ndarray], capacity: int, dim: int = 4) -> tuple[int, dict]:
    """Return the misses of our ``EmbeddingTable`` (LRU) fed ``batches`` of distinct keys."""
    from recsys.features.schema import TableSpec
    from recsys.store.config import StoreConfig
    from recsys.store.tables.table import EmbeddingTable

    table = EmbeddingTable("lru", TableSpec(dim=dim, capacity=capacity), StoreConfig())
    for step, keys in enumerate(batches):
        table.lookup(keys, step)
    c = table.counters()
    return c["misses"], c


def _measure_lru(s: Settings) -> dict:
    from recsys.features import hashing

    rng = np.random.default_rng([s.seed, 1_000_003])
    ranks = zipf_ranks(rng, s.lru_ids, s.lru_universe, s.zipf_a)
    keys = hashing.hash_int64(ranks, "lru")
    batches = [np.unique(keys[i : i + s.lru_batch]) for i in range(0, s.lru_ids, s.lru_batch)]
    requests = np.concatenate(batches)
    distinct = int(np.unique(keys).shape[0])
    capacity = max(int(round(s.lru_capacity_fraction * distinct)), max(b.shape[0] for b in batches))
    t0 = time.perf_counter()
    lru, counters = lru_misses(batches, capacity)
    t_lru = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt = belady_misses(requests, capacity)
    t_opt = time.perf_counter() - t0
    n = s.lru_ids
    return {
        "comparison": comparison(
            "LRU miss rate vs Belady MIN, cap 10% (lower better)", lru / n, opt / n, "misses/id",
            target_ratio=None,
        ),
        "detail": {
            "ids": n,
            "universe": s.lru_universe,
            "distinct_keys": distinct,
            "capacity": capacity,
            "batch": s.lru_batch,
            "requests_after_batch_dedup": int(requests.shape[0]),
            "lru_misses": int(lru),
            "belady_misses": int(opt),
            "compulsory_misses": distinct,
            "lru_miss_rate_per_request": lru / requests.shape[0],
            "belady_miss_rate_per_request": opt / requests.shape[0],
            "lru_evictions": int(counters["evictions"]),
            "seconds": {"lru": t_lru, "belady": t_opt},
        },
    }


# --------------------------------------------------------------------------- 4. two ranks vs one


def _dist_rank(rank: int, world: int, s: Settings) -> dict:
    """One rank of comparison 4; returns timings (rank 0), losses and idle CPU (rank 1)."""
    import torch
    import torch.distributed as dist

    from recsys.store.config import StoreConfig
    from recsys.store.sharded.store import ShardedEmbeddingStore

    torch.set_num_threads(1)
    rounds = s.dist_warmup_rounds + s.dist_repeats
    keys = make_trace(s, rounds * s.dist_steps)
    n_b, T, B = keys.shape
    half = B // world
    distinct = [int(np.unique(keys[:, t, :]).shape[0]) for t in range(T)]
    capacities = [int(math.ceil(n * s.capacity_headroom)) + 64 for n in distinct]
    schema = _schema(s, capacities)
    cfg = StoreConfig(lr=s.lr)
    solo_group = dist.new_group(ranks=[0], backend="gloo")
    # threads: the store's per-table threads as a 1-process job of 2 threads and a
    # 2-process job of 1 thread each would have them
    store2 = ShardedEmbeddingStore(schema, dataclasses.replace(cfg, host=dataclasses.replace(cfg.host, threads=1)))  # its own gloo group of all ranks
    store1 = (ShardedEmbeddingStore(schema, dataclasses.replace(cfg, host=dataclasses.replace(cfg.host, threads=2)), group=solo_group)
              if rank == 0 else None)
    kjt_half = [_kjt(keys[b, :, rank * half : (rank + 1) * half]) for b in range(n_b)]
    kjt_full = [_kjt(keys[b]) for b in range(n_b)] if rank == 0 else None
    del keys
    W = _upstream(s)
    times = {"1 rank": [], "2 ranks": []}
    losses = {"1 rank": [], "2 ranks": []}
    idle_cpu = []
    comm0: dict = {}
    for r in range(rounds):
        batches = range(r * s.dist_steps, (r + 1) * s.dist_steps)
        order = ("1 rank", "2 ranks") if r % 2 == 0 else ("2 ranks", "1 rank")
        for phase in order:
            gc.collect()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if phase == "1 rank":
                if rank == 0:
                    torch.set_num_threads(2)
                    losses[phase].extend(_ours_steps(store1, [kjt_full[b] for b in batches], W, batches[0]))
                    torch.set_num_threads(1)
                dt = time.perf_counter() - t0
                dist.barrier()
                if rank != 0:
                    idle_cpu.append(time.process_time() - c0)
            else:
                losses[phase].extend(_ours_steps(store2, [kjt_half[b] for b in batches], W, batches[0]))
                dist.barrier()
                dt = time.perf_counter() - t0
            if r >= s.dist_warmup_rounds:
                times[phase].append(dt)
        if r == s.dist_warmup_rounds - 1:
            comm0 = store2.comm_stats()
    comm = {k: {f: v[f] - comm0.get(k, {}).get(f, 0) for f in v} for k, v in store2.comm_stats().items()}
    transfer = _transfer_only(comm, store2.group, s.dist_repeats * s.dist_steps)
    store2.close()
    if store1 is not None:
        store1.close()
    return {"times": times, "losses": losses, "idle_cpu_s": idle_cpu, "distinct": distinct, "comm": comm,
            "transfer_only": transfer}


def _transfer_only(comm: dict, group, steps: int, repeats: int = 15) -> dict:
    """Return the median seconds of one all-to-all of each kind's mean payload per call,
    both ranks ready (a barrier first): what the transfer costs without waiting for a peer."""
    import torch
    import torch.distributed as dist

    out = {}
    world = dist.get_world_size(group)
    for kind, c in sorted(comm.items()):
        mine = max(1, int(round(c["bytes_sent"] / max(c["calls"], 1) / 4 / max(world - 1, 1))))
        agreed = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)  # one payload size for every rank
        per_rank = int(agreed.item())
        send = torch.zeros(per_rank * world, dtype=torch.float32)
        recv = torch.empty_like(send)
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            times.append(time.perf_counter() - t0)
        out[kind] = {"bytes_per_peer": per_rank * 4, "median_s": float(np.median(times)),
                     "calls_per_step": c["calls"] / steps}
    return out


def _measure_dist(s: Settings) -> dict:
    from recsys.runtime.spawn import run_gloo

    world = 2
    results = run_gloo(_dist_rank, world, s, timeout=s.dist_timeout_s)
    r0, r1 = results
    samples = s.dist_steps * s.batch
    best = {k: min(v) for k, v in r0["times"].items()}
    one = np.array(r0["losses"]["1 rank"])
    two = (np.array(r0["losses"]["2 ranks"]) + np.array(r1["losses"]["2 ranks"])) / world
    return {
        "comparison": comparison(
            "2 ranks x 1 thread vs 1 rank x 2 threads", samples / best["2 ranks"], samples / best["1 rank"],
            "samples/s", target_ratio=None,
        ),
        "detail": {
            "threads": {"1 rank": 2, "2 ranks": "1 per rank"},
            "batch_per_rank": {"1 rank": s.batch, "2 ranks": s.batch // world},
            "seconds_per_run": r0["times"],
            "median_samples_per_s": {k: samples / float(np.median(v)) for k, v in r0["times"].items()},
            "idle_rank1_cpu_s_during_1_rank_runs": r1["idle_cpu_s"],
            "max_abs_loss_diff_2_vs_1": float(np.max(np.abs(one - two))),
            "all_to_all": _all_to_all_report(r0, r1, s),
        },
    }


def _all_to_all_report(r0: dict, r1: dict, s: Settings) -> dict:
    """Per step of the 2-rank runs: each kind's all-to-alls, time inside them (transfer and
    waiting for the other rank) per rank, bytes that crossed, and the same payload's
    transfer alone; against the 2-rank step's median time."""
    steps = s.dist_repeats * s.dist_steps
    step_s = float(np.median(r0["times"]["2 ranks"])) / s.dist_steps
    kinds = {}
    for kind in sorted(r0["comm"]):
        c0, c1 = r0["comm"][kind], r1["comm"].get(kind, {})
        kinds[kind] = {
            "calls_per_step": c0["calls"] / steps,
            "ms_per_step_rank0": 1e3 * c0["seconds"] / steps,
            "ms_per_step_rank1": 1e3 * c1.get("seconds", 0.0) / steps,
            "kib_sent_per_step_rank0": c0["bytes_sent"] / steps / 1024,
            "kib_received_per_step_rank0": c0["bytes_received"] / steps / 1024,
            "transfer_only_ms_per_call": 1e3 * r0["transfer_only"][kind]["median_s"],
        }
    total0 = sum(k["ms_per_step_rank0"] for k in kinds.values())
    total1 = sum(k["ms_per_step_rank1"] for k in kinds.values())
    transfer = sum(k["transfer_only_ms_per_call"] * k["calls_per_step"] for k in kinds.values())
    return {"step_ms": 1e3 * step_s, "in_all_to_all_ms_per_step": {"rank0": total0, "rank1": total1},
            "transfer_only_ms_per_step": transfer,
            "share_of_step_rank0": total0 / (1e3 * step_s), "kinds": kinds}


# --------------------------------------------------------------------------- entry


def measure(quick: bool, data=None, settings: Settings | None = None) -> dict:
    """Return the four store comparisons (``settings`` overrides the preset sizes)."""
    s = settings if settings is not None else (QUICK if quick else FULL)

    def run() -> dict:
        with quiet_fbgemm():
            import torchrec  # noqa: F401 - loads fbgemm, which logs a line per library
        _fbgemm()
        return _measure_all(s)

    return with_passive_omp(run)


def _measure_all(s: Settings) -> dict:
    seconds = {}
    t0 = time.perf_counter()
    step = _measure_step(s)
    seconds["train_step"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mem = _in_fresh_process(_measure_memory, s)
    seconds["memory"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lru = _measure_lru(s)
    seconds["lru"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    two = _measure_dist(s)
    seconds["two_ranks"] = time.perf_counter() - t0
    parts = {"train_step": step, "memory": mem, "lru": lru, "two_ranks": two}
    return {
        "comparisons": [p["comparison"] for p in parts.values()],
        "details": {k: p["detail"] for k, p in parts.items()},
        "settings": {
            **dataclasses.asdict(s),
            "tables": s.tables,
            "optimizer": "rowwise_adagrad",
            "baseline_kernel": "fbgemm_gpu SplitTableBatchedEmbeddingBagsCodegen, EXACT_ROWWISE_ADAGRAD, "
            "EmbeddingLocation.HOST, ComputeDevice.CPU, PoolingMode.SUM, FP32",
            "dist_threads": {"1 rank": 2, "2 ranks": 1},
        },
        "versions": versions(),
        "seconds_per_part": seconds,
    }
