"""The arithmetic of ``recsys bench scale`` (``recsys.bench.scale``), apart from its measuring:
the run's settings, each size's id universes and table capacities, the plan of the next size
(in memory, spilled, or stopped) from the host's available memory and the per-row costs
measured so far, and the cost model that extrapolates the measured costs to 1 B ids. Numpy
only: no torch, no Redis, no store.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from recsys.bench.store import CRITEO_CARDINALITIES

MIN_TABLE_IDS = 100
"""A table keeps at least ``min(its Criteo cardinality, MIN_TABLE_IDS)`` ids at any size."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sizes of one benchmark run (``FULL``, ``QUICK``; tests pass tiny ones)."""

    sizes: tuple[int, ...] = (1_000_000, 10_000_000, 100_000_000)
    """Distinct ids per size (before the tables' minimum sizes are added)."""
    batch: int = 4096
    zipf_a: float = 1.05
    chunk: int = 20
    """Steps per timed segment (and per metrics window)."""
    warmup_chunks: int = 2
    timed_chunks: int = 6
    threads: int = 2
    prefill_rows: int = 250_000
    """Ids per prefill lookup (all tables together)."""
    spill_capacity_fraction: float = 0.1
    """Spilled sizes: rows kept in memory, as a fraction of the distinct ids."""
    memory_limit_rows: int | None = None
    """Spill every size above this many ids (None: as the host's memory decides)."""
    memory_budget_fraction: float = 0.8
    """Share of the host's available memory a size may plan to use (store, checkpoint, Redis)."""
    size_timeout_s: float = 7200.0
    seed: int = 0

    @property
    def steps(self) -> int:
        """Training steps per size: warm-up, the timed segments and the step after the last
        pause point (the last batch is fetched one step before the end)."""
        return self.chunk * (self.warmup_chunks + self.timed_chunks) + 1


FULL = Settings()
QUICK = Settings(sizes=(10_000, 100_000), batch=1024, chunk=3, warmup_chunks=1, timed_chunks=3,
                 prefill_rows=50_000, memory_limit_rows=10_000, spill_capacity_fraction=0.5)


# --------------------------------------------------------------------------- the data



def universes(n: int) -> list[int]:
    """Return the ids per table for ``n`` distinct ids: Criteo's proportions, each table at
    least ``min(its Criteo cardinality, MIN_TABLE_IDS)``."""
    total = sum(CRITEO_CARDINALITIES)
    return [max(min(c, MIN_TABLE_IDS), round(c * n / total)) for c in CRITEO_CARDINALITIES]


def capacities(s: Settings, unis: list[int], spill_fraction: float | None) -> list[int]:
    """Return each table's capacity: its universe in memory; spilled, its share of the ids,
    but at least two batches' worth of keys (a step's keys must fit, and its look-ahead's)."""
    if spill_fraction is None:
        return list(unis)
    return [min(u, max(math.ceil(u * spill_fraction), 2 * s.batch)) for u in unis]


def _ranks(s: Settings, table: int, universe: int, n: int) -> np.ndarray:
    from recsys.io.zipf import zipf_ranks

    return zipf_ranks(np.random.default_rng([s.seed, table]), n, universe, s.zipf_a)


# --------------------------------------------------------------------------- the plan


def mem_available() -> int:
    """Return the host's available memory in bytes (``MemAvailable``; 0 if unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _estimates(done: list[dict]) -> dict:
    """Return the per-row costs the next size is planned with: the latest measured ones
    (the first size's are generous guesses)."""
    est = {"store_bytes_per_row": 400.0, "peak_bytes_per_id": 800.0, "transient_bytes_per_id": 400.0,
           "redis_bytes_per_row": 250.0}
    for r in done:
        est["store_bytes_per_row"] = r["bytes_per_row"]
        est["transient_bytes_per_id"] = max(0.0, r["peak_bytes_per_id_over_start"]
                                            - r["store_rss_bytes"] / r["distinct_ids"])
        if r["mode"] == "memory":
            est["peak_bytes_per_id"] = r["peak_bytes_per_id_over_start"]
        if r.get("redis_bytes_per_spilled_row", 0) > 0:
            est["redis_bytes_per_row"] = r["redis_bytes_per_spilled_row"]
    return est


def need_bytes(n: int, spill_fraction: float | None, est: dict) -> dict:
    """Return the memory a size is planned to need: the process (store and checkpoint) and Redis."""
    d = sum(universes(n))
    if spill_fraction is None:
        return {"process": d * est["peak_bytes_per_id"], "redis": 0.0}
    kept = d * spill_fraction
    # Redis holds the spilled rows, plus a copy of each row the timed steps bring back into
    # memory (``store.spill.delete_restored`` is off): ~5 k a step at 50 M ids, under
    # 1 M rows in a run, inside the budget's margin; a long run may add up to ``kept`` rows
    return {"process": kept * est["store_bytes_per_row"] + d * est["transient_bytes_per_id"],
            "redis": (d - kept) * est["redis_bytes_per_row"]}


def plan_size(s: Settings, n: int, previous: int | None, done: list[dict], available: int) -> dict:
    """Return how to run ``n`` ids: ``{"ids", "spill_fraction", "need"}``, or ``{"stopped": why}``.

    In memory while it fits (and ``n <= memory_limit_rows``); else spilled; a spilled size
    that does not fit is tried at 5, 3, 2 × ``previous`` before stopping."""
    est, budget = _estimates(done), available * s.memory_budget_fraction
    forced = s.memory_limit_rows is not None and n > s.memory_limit_rows
    if not forced:
        need = need_bytes(n, None, est)
        if sum(need.values()) <= budget:
            return {"ids": n, "spill_fraction": None, "need": need}
    tried = [n] + [previous * k for k in (5, 3, 2) if previous and previous * k < n]
    for m in tried:
        need = need_bytes(m, s.spill_capacity_fraction, est)
        if sum(need.values()) <= budget:
            return {"ids": m, "spill_fraction": s.spill_capacity_fraction, "need": need}
    need = need_bytes(n, s.spill_capacity_fraction, est)
    return {"stopped": f"{_label(n)} ids spilled would need {sum(need.values()) / 2**30:.1f} GiB (process "
                       f"{need['process'] / 2**30:.1f}, Redis {need['redis'] / 2**30:.1f}; from the per-row costs "
                       f"measured so far) and {_label(tried[-1])} too; {available / 2**30:.1f} GiB available, "
                       f"{s.memory_budget_fraction:.0%} of it planned"}


def _label(n: int) -> str:
    for unit, div in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return str(n)


# --------------------------------------------------------------------------- the cost model


def unique_keys_per_step(s: Settings, n: int, batches: int = 5) -> float:
    """Return the mean distinct keys of one batch (all tables) at ``n`` ids, drawn from the
    bench's id law (no store involved: a property of the data)."""
    unis = universes(n)
    return float(np.mean([sum(np.unique(_ranks(dataclasses.replace(s, seed=s.seed + 1 + k), t, u, s.batch)).shape[0]
                              for t, u in enumerate(unis)) for k in range(batches)]))


def cost_model(s: Settings, sizes: list[dict], ids: int = 10**9, node_memory_gib: float = 24.0) -> dict:
    """Return the extrapolation to ``ids`` rows from the per-row costs measured at the largest
    in-memory size: its marginal bytes per row (else its bytes per row) for the store, and its
    peak resident bytes per id (the checkpoint and restore hold a copy of every row), each
    against 80 % of ``node_memory_gib`` per node; the checkpoint's bytes on disk; and the
    all-to-all bytes per step and rank (a key out, its row back, its gradient out, float32;
    ``(W - 1) / W`` of them leave the node) at the distinct keys per batch the id law gives at
    ``ids`` (``unique_keys_per_step``), next to those measured."""
    mem = [r for r in sizes if r["mode"] == "memory"] or sizes
    ref = max(mem, key=lambda r: r["distinct_ids"])
    bpr = ref.get("marginal_bytes_per_row", ref["bytes_per_row"])
    peak = ref["peak_bytes_per_id_over_start"]
    usable = node_memory_gib * 2**30 * 0.8
    nodes_store, nodes_peak = math.ceil(ids * bpr / usable), math.ceil(ids * peak / usable)
    unique = unique_keys_per_step(s, ids)
    per_key = 8 + 2 * ref["dim"] * 4
    nodes = max(nodes_store, nodes_peak)
    return {
        "ids": ids, "from_size": ref["distinct_ids"], "node_memory_gib": node_memory_gib,
        "bytes_per_row": bpr, "peak_bytes_per_id": peak,
        "nodes_for_the_store": nodes_store, "nodes_for_checkpoints": nodes_peak, "nodes": nodes,
        "rows_per_node": math.ceil(ids / nodes), "store_gib_per_node": ids / nodes * bpr / 2**30,
        "peak_gib_per_node": ids / nodes * peak / 2**30,
        "checkpoint_bytes": ids * ref["checkpoint_bytes_per_id"],
        "unique_keys_per_step_measured": {r["distinct_ids"]: r["unique_keys_per_step"] for r in sizes},
        "unique_keys_per_step": unique, "bytes_per_key": per_key,
        "all_to_all_bytes_per_step_per_rank": {w: unique * per_key * (w - 1) / w
                                               for w in sorted({nodes, 2 * nodes, 4 * nodes})},
    }
