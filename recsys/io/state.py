"""Reader progress: per-epoch records, their JSON form, merging rank states, re-dealing.

State (JSON, ``version`` 1)::

    {"version": 1, "seed": s, "shuffle": bool,
     "layout": {"world_size": R, "slots_per_rank": W},
     "ranks": [ranks whose progress this state holds],
     "units": [[unit key, rows], ...],          # the data set, checked on load
     "skipped": [unit keys found bad while reading],
     "epoch": e,                                # progress in epoch e:
     "generation": g,                           #   dealing number (+1 per re-deal)
     "consumed": {unit key: rows delivered},    #   units with progress only
     "slots": [{"units": [unit index], "batches": k, "done": bool}, ...],
     "later": [{"generation", "consumed", "slots"}, ...]}   # progress already made in e+1, e+2...

``later`` exists because ranks drift: with uneven shares, a rank that finished its part of
epoch e goes on into e+1 while others still read e (step-based training). A merged state
holds every epoch some rank is in: in epoch x, the slots of ranks already past x are done,
and a rank still before x finds its progress there when it gets to x.

Only delivered rows count. A slot's unit list is its dealing for this generation; unit
indices refer to ``units``. Units not in any slot (finished before a re-deal) are out of
this epoch's remaining work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recsys.io.plan import deal, epoch_order

STATE_VERSION = 1


@dataclass(slots=True)
class Progress:
    """Progress through one epoch under one dealing (generation)."""

    epoch: int
    generation: int
    slots: list[list[int]]
    """Unit indices per slot, in the order the slot reads them."""
    batches: list[int]
    """Batches delivered per slot."""
    done: list[bool]
    """Slot finished (its end was delivered, or its rank moved to the next epoch)."""
    consumed: np.ndarray
    """int64 [U] rows delivered per unit."""

    @classmethod
    def fresh(cls, epoch: int, rows: np.ndarray, num_slots: int, seed: int, shuffle: bool) -> "Progress":
        """Return the start of ``epoch``: all units dealt to ``num_slots`` slots (generation 0)."""
        order = epoch_order(list(range(len(rows))), seed, epoch, 0, shuffle)
        return cls(
            epoch=epoch,
            generation=0,
            slots=deal(order, rows, num_slots),
            batches=[0] * num_slots,
            done=[False] * num_slots,
            consumed=np.zeros(len(rows), dtype=np.int64),
        )

    def remaining(self, slot: int, rows: np.ndarray, skipped: set[int]) -> int:
        """Rows the slot has not delivered yet (by the footers' counts)."""
        return int(sum(rows[u] - self.consumed[u] for u in self.slots[slot] if u not in skipped))

    def redeal(self, rows: np.ndarray, skipped: set[int], num_slots: int, seed: int, shuffle: bool) -> "Progress":
        """Return the unfinished units dealt over ``num_slots`` new slots (next generation).

        Units of finished slots stay out: their rank may have moved on without saying how
        far it got, and rows drop_last left there are not read again this epoch.
        """
        left = [
            u
            for j, units in enumerate(self.slots)
            if not self.done[j]
            for u in units
            if u not in skipped and self.consumed[u] < rows[u]
        ]
        generation = self.generation + 1
        order = epoch_order(left, seed, self.epoch, generation, shuffle)
        return Progress(
            epoch=self.epoch,
            generation=generation,
            slots=deal(order, rows - self.consumed, num_slots),
            batches=[0] * num_slots,
            done=[False] * num_slots,
            consumed=self.consumed.copy(),
        )

    def to_json(self, keys: list[str]) -> dict:
        """Return the JSON record (without the epoch, which the caller places)."""
        return {
            "generation": self.generation,
            "consumed": {keys[u]: c for u, c in enumerate(self.consumed.tolist()) if c},
            "slots": [
                {"units": list(units), "batches": b, "done": d}
                for units, b, d in zip(self.slots, self.batches, self.done)
            ],
        }

    @classmethod
    def from_json(cls, epoch: int, record: dict, key_index: dict[str, int], rows: np.ndarray) -> "Progress":
        """Return the record as Progress; ValueError if it does not fit the data set."""
        U = len(rows)
        consumed = np.zeros(U, dtype=np.int64)
        for key, c in record["consumed"].items():
            u = unit_index(key_index, key)
            if not isinstance(c, int) or not 0 <= c <= rows[u]:
                raise ValueError(f"reader state: unit {key!r} consumed {c!r} of {int(rows[u])} rows")
            consumed[u] = c
        dealt = [u for sl in record["slots"] for u in sl["units"]]
        if len(set(dealt)) != len(dealt) or not all(isinstance(u, int) and 0 <= u < U for u in dealt):
            raise ValueError(f"reader state (epoch {epoch}): slots must hold unit indices, each at most once")
        return cls(
            epoch=epoch,
            generation=int(record["generation"]),
            slots=[list(sl["units"]) for sl in record["slots"]],
            batches=[int(sl["batches"]) for sl in record["slots"]],
            done=[bool(sl["done"]) for sl in record["slots"]],
            consumed=consumed,
        )


def unit_index(key_index: dict[str, int], key: str) -> int:
    try:
        return key_index[key]
    except KeyError:
        raise ValueError(f"reader state names unit {key!r}, which this data set lacks") from None


# --------------------------------------------------------------------------- checks


_STATE_KEYS = {
    "version": int, "epoch": int, "generation": int, "seed": int, "shuffle": bool,
    "layout": dict, "ranks": list, "units": list, "consumed": dict, "skipped": list, "slots": list,
    "later": list,
}
_RECORD_KEYS = {"generation": int, "consumed": dict, "slots": list}


def check_shape(state: dict) -> None:
    """Raise ValueError unless ``state`` has the shape of a version-1 reader state."""
    if not isinstance(state, dict):
        raise ValueError(f"reader state must be a dict, found {type(state).__name__}")
    version = state.get("version")
    if version != STATE_VERSION:
        raise ValueError(f"reader state version {version!r} is not supported (expected {STATE_VERSION})")
    _check_keys(state, _STATE_KEYS, "reader state")
    layout = state["layout"]
    if not {"world_size", "slots_per_rank"} <= set(layout):
        raise ValueError(f"reader state layout must name world_size and slots_per_rank, found {layout}")
    num_slots = layout["world_size"] * layout["slots_per_rank"]
    for i, rec in enumerate(state["later"]):
        _check_keys(rec, _RECORD_KEYS, f"reader state later[{i}]")
    for rec in [state, *state["later"]]:
        if len(rec["slots"]) != num_slots:
            raise ValueError(
                f"reader state: {len(rec['slots'])} slots, but its layout {layout} has {num_slots}"
            )
        for sl in rec["slots"]:
            if not isinstance(sl, dict) or not {"units", "batches", "done"} <= set(sl):
                raise ValueError(f"reader state: a slot must have units, batches and done, found {sl!r}")


def _check_keys(data: dict, keys: dict, what: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a dict, found {type(data).__name__}")
    for key, tp in keys.items():
        if key not in data:
            raise ValueError(f"{what} lacks {key!r}")
        if not isinstance(data[key], tp):
            raise ValueError(f"{what} {key!r}: expected {tp.__name__}, found {type(data[key]).__name__}")


# --------------------------------------------------------------------------- merging


def _record_at(state: dict, epoch: int) -> dict | None:
    """Return the state's progress record of ``epoch`` (None if it holds none)."""
    if epoch == state["epoch"]:
        return {k: state[k] for k in ("generation", "consumed", "slots")}
    i = epoch - state["epoch"] - 1
    return state["later"][i] if 0 <= i < len(state["later"]) else None


def _max_consumed(records: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in records:
        for k, c in rec["consumed"].items():
            out[k] = max(out.get(k, 0), int(c))
    return out


def merge_states(states: list[dict]) -> dict:
    """Return one global state from every rank's state (all taken at the same point).

    Each rank is authoritative for its own slots; consumed counts are maxima (they only
    grow). Ranks may be in different epochs (see module docstring).
    """
    if not states:
        raise ValueError("merge_states needs at least one state")
    for s in states:
        check_shape(s)
    first = states[0]
    layout = first["layout"]
    world, per_rank = layout["world_size"], layout["slots_per_rank"]
    for s in states[1:]:
        if s["layout"] != layout:
            raise ValueError(f"states have different layouts: {layout} vs {s['layout']}")
        if s["units"] != first["units"]:
            raise ValueError("states were saved for different data sets (unit lists differ)")
        if (s["seed"], s["shuffle"]) != (first["seed"], first["shuffle"]):
            raise ValueError("states were saved with different seed/shuffle settings")
    ranks = sorted(r for s in states for r in s["ranks"])
    if ranks != list(range(world)):
        raise ValueError(f"states must cover ranks 0..{world - 1} once each, found ranks {ranks}")
    by_rank = {r: s for s in states for r in s["ranks"]}
    rows = np.array([n for _, n in first["units"]], dtype=np.int64)
    lo = min(s["epoch"] for s in states)
    hi = max(s["epoch"] + len(s["later"]) for s in states)
    records = []
    for epoch in range(lo, hi + 1):
        sources = [r for r in (_record_at(s, epoch) for s in states) if r is not None]
        if sources:
            generations = sorted({r["generation"] for r in sources})
            if len(generations) != 1:
                raise ValueError(
                    f"states of epoch {epoch} have different generations {generations}: "
                    "they were not resumed from the same merged state"
                )
            base = sources[0]
        else:  # ranks before and after it, none inside: its start
            base = _fresh_record(epoch, rows, world * per_rank, first["seed"], first["shuffle"])
        slots = []
        for j, sl in enumerate(base["slots"]):
            owner = by_rank[j // per_rank]
            own = _record_at(owner, epoch)
            if owner["epoch"] > epoch:  # that rank finished its part of this epoch
                slots.append({"units": sl["units"], "batches": sl["batches"], "done": True})
            elif own is None:  # that rank has not reached this epoch yet
                slots.append({"units": sl["units"], "batches": 0, "done": False})
            else:
                mine = own["slots"][j]
                slots.append({"units": sl["units"], "batches": mine["batches"], "done": mine["done"]})
        records.append({"generation": base["generation"], "consumed": _max_consumed(sources), "slots": slots})
    return {
        **{k: first[k] for k in ("version", "seed", "shuffle", "layout", "units")},
        "ranks": list(range(world)),
        "skipped": sorted({k for s in states for k in s["skipped"]}),
        "epoch": lo,
        **records[0],
        "later": records[1:],
    }


def _fresh_record(epoch: int, rows: np.ndarray, num_slots: int, seed: int, shuffle: bool) -> dict:
    p = Progress.fresh(epoch, rows, num_slots, seed, shuffle)
    return {"generation": 0, "consumed": {}, "slots": [{"units": u, "batches": 0, "done": False} for u in p.slots]}
