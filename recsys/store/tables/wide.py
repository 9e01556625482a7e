"""The wide arm's weights (``model.wide``): one scalar per key, in dim-1 tables of a store.

Logistic regression on one-hot ids learns a weight per id; a deep model only learns it
through its embeddings and towers. ``model.wide = true`` adds, for every sparse feature,
the sum of its ids' scalar weights to the logit (Wide & Deep's wide part, DeepFM's first
order). The weights are keyed like the embeddings, so they stay unbounded, LRU-bounded
per table, sharded by owner and checkpointed by key like any row:

    table ``c1`` (dim D)  ──►  table ``c1.wide`` (dim 1, starts at 0, same capacity,
                               folding, optimizer, admission and spill namespace)

The store keeps one dim per instance (its rows move as one ``[U, D]`` block), so the wide
tables live in a second ``ShardedEmbeddingStore`` with its own process group and worker;
``WideStore`` pairs the two behind the store's interface, so the trainer and ``recsys
eval`` drive both with the same calls (a lookup, a push, a checkpoint).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable

from recsys.features.schema import FeatureSpec, Schema, TableSpec

SUFFIX = ".wide"


def wide_table(table: str) -> str:
    """Return the name of ``table``'s wide (dim-1) table."""
    return table + SUFFIX


def wide_schema(schema: Schema) -> Schema:
    """Return the schema of the wide tables: every sparse feature reading a dim-1 table. An
    id-score list (``weighted``) stays one: its wide term is Σ score × weight, as its
    embedding is Σ score × row (logistic regression's term for a valued feature)."""
    tables = {wide_table(name): TableSpec(dim=1, capacity=spec.capacity, num_rows=spec.num_rows)
              for name, spec in schema.tables.items()}
    sparse = [FeatureSpec(name=f.name, column=f.column, kind=f.kind, multi_hot=f.multi_hot,
                          table=wide_table(f.table), pooling=f.pooling, weighted=f.weighted,
                          weight_column=f.weight_column) for f in schema.sparse]
    return Schema(label=schema.label, sparse=sparse, tables=tables)


class _Only(Mapping):
    """The tables of ``state`` that ``names`` holds, read from ``state`` when asked for (a
    checkpoint's ``SavedTables`` stays lazy: one table in memory at a time)."""

    def __init__(self, state: Mapping, names) -> None:
        self._state = state
        self._names = [n for n in state if n in names]

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(name)
        return self._state[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _PairFuture:
    def __init__(self, deep, wide) -> None:
        self.deep, self.wide = deep, wide

    def result(self) -> "PairLookup":
        return PairLookup(self.deep.result(), self.wide.result())


@dataclasses.dataclass(slots=True)
class PairLookup:
    """A lookup of both stores: ``pooled`` the embeddings [B, F, D], ``wide_pooled`` the
    summed (or averaged, with mean pooling) weights [B, F, 1]."""

    deep: object
    wide: object

    @property
    def step(self):
        return self.deep.step

    def pooled(self, num_features: int | None = None):
        return self.deep.pooled(num_features)

    def wide_pooled(self, num_features: int | None = None):
        return self.wide.pooled(num_features)


class WideStore:
    """The embedding store and the wide-weight store driven together (see module doc).

    Everything else (peeks, counters' callers) goes to the embedding store. Live pushes
    (``attach_publisher``) go from both: one publisher per store, on its own op sequence."""

    def __init__(self, deep, wide) -> None:
        self.deep, self.wide = deep, wide
        self.publisher = None
        """Both stores' live publishers as one (``attach_publisher``), or None."""

    def __getattr__(self, name):
        return getattr(self.deep, name)

    def lookup(self, kjt, step, train: bool = True) -> PairLookup:
        return PairLookup(self.deep.lookup(kjt, step, train), self.wide.lookup(kjt, step, train))

    def submit_lookup(self, kjt, step, train: bool = True) -> _PairFuture:
        return _PairFuture(self.deep.submit_lookup(kjt, step, train), self.wide.submit_lookup(kjt, step, train))

    def push(self, lookup: PairLookup) -> None:
        self.deep.push(lookup.deep)
        self.wide.push(lookup.wide)

    def cancel(self, lookup: PairLookup) -> None:
        self.deep.cancel(lookup.deep)
        self.wide.cancel(lookup.wide)

    def flush(self, through_step: int | None = None) -> None:
        self.deep.flush(through_step)
        self.wide.flush(through_step)

    def close(self) -> None:
        try:
            self.deep.close()
        finally:
            self.wide.close()

    def attach_publisher(self, make: Callable, make_wide: Callable, combine: Callable) -> None:
        """Attach live publishers: ``make(read_rows)`` to the embedding store,
        ``make_wide(read_rows)`` to the wide store (``ShardedEmbeddingStore.attach_publisher``);
        ``publisher`` becomes ``combine([embeddings' publisher, wide's])``."""
        self.deep.attach_publisher(make)
        self.wide.attach_publisher(make_wide)
        self.publisher = combine([self.deep.publisher, self.wide.publisher])

    def finish_publisher(self, step: int) -> bool:
        """Write both publishers' last snapshots (each on its store's op sequence)."""
        deep = self.deep.finish_publisher(step)
        return self.wide.finish_publisher(step) and deep

    def counters(self) -> dict[str, dict[str, int]]:
        return {**self.deep.counters(), **self.wide.counters()}

    def state_dict(self) -> dict:
        state: dict = {}
        self.write_state(state.__setitem__)
        return state

    def write_state(self, each) -> None:
        self.deep.write_state(each)
        self.wide.write_state(each)

    def load_state_dict(self, state: dict, admission: dict | None = None) -> None:
        """Load both stores' tables; ``admission`` holds both stores' tables (names differ)."""
        self.deep.load_state_dict(_Only(state, self.deep.tables), admission=admission)
        self.wide.load_state_dict(_Only(state, self.wide.tables), admission=admission)

    def admission_state_dict(self) -> dict:
        """One ``admission`` payload with both stores' tables (collective; ``{}`` off rank 0)."""
        deep, wide = self.deep.admission_state_dict(), self.wide.admission_state_dict()
        if not deep:
            return deep
        merged = dict(deep["admission"])
        merged["tables"] = {**deep["admission"]["tables"], **wide["admission"]["tables"]}
        return {"admission": merged}


def wide_store_config(cfg, model=None):
    """Return the wide store's settings: the embedding store's, with new weights at 0 (an
    id never trained adds nothing to the logit) and ``model``'s (a ``ModelConfig``)
    ``wide_lr`` / ``wide_initial_accumulator`` / ``wide_weight_decay`` where set."""
    changes = {"init_scale": 0.0}
    if model is not None:
        for ours, theirs in (("wide_lr", "lr"), ("wide_initial_accumulator", "initial_accumulator"),
                             ("wide_weight_decay", "weight_decay")):
            if getattr(model, ours) is not None:
                changes[theirs] = getattr(model, ours)
    return dataclasses.replace(cfg, **changes)


def table_names(schema: Schema, wide: bool) -> list[str]:
    """Return every table a checkpoint of a job holds (its wide tables too with ``model.wide``)."""
    names = list(schema.tables)
    return names + [wide_table(n) for n in names] if wide else names
