"""The store's contracts, declared: what the trainer and ``recsys eval`` call on a store, a
lookup and a table, whichever implementation is behind them.

    EmbeddingStore   ShardedEmbeddingStore (recsys/store/sharded/store.py); WideStore
                     (recsys/store/tables/wide.py: the embeddings' store and the wide arm's, driven
                     as one)
    StoreLookup      Lookup (sharded.py); PairLookup (wide.py)
    Table            EmbeddingTable (recsys/store/tables/table.py: host rows, LRU, spill tier);
                     DeviceCache (recsys/store/device/cache.py: a device tier in front of one);
                     DeviceTable (recsys/store/device/table.py: a whole table on a device)

A walk through evaluation or a training step stops at these names: every ``lookup`` the
trainer calls is ``EmbeddingStore.lookup``, every row read below it ``Table.lookup`` /
``Table.peek``. ``tests/test_store_protocols.py`` checks that each implementation has every
method with the declared parameters. Nothing here runs; it imports no torch.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class StoreLookup(Protocol):
    """A batch's rows, ready for the model (``pooled``) and for the push (after backward)."""

    step: int | None

    def pooled(self, num_features: int | None = None) -> Any:
        """Return the pooled embeddings [B, F, D] in schema feature order."""


@runtime_checkable
class EmbeddingStore(Protocol):
    """Rows of every table by key, sharded by owner; lookups, pushes, checkpoints."""

    staleness: int
    publisher: Any

    def lookup(self, kjt: Any, step: int | None, train: bool = True) -> StoreLookup:
        """Return the batch's rows; ``train`` promises a ``push`` or a ``cancel``."""

    def submit_lookup(self, kjt: Any, step: int | None, train: bool = True) -> Any:
        """Return a future of ``lookup`` (its ``result()``)."""

    def push(self, lookup: Any) -> None:
        """Queue the row gradients of ``lookup`` (after backward) for their owners."""

    def cancel(self, lookup: Any) -> None:
        """Withdraw the push a training lookup promised."""

    def flush(self, through_step: int | None = None) -> None:
        """Apply every queued push of steps ``<= through_step`` (all when None) now."""

    def close(self) -> None:
        """Apply queued pushes, stop the store's threads, close every table."""

    def counters(self) -> dict[str, dict[str, int]]:
        """Return each table's counters (hits, misses, evictions, rows...)."""

    def state_dict(self) -> dict:
        """Return every row this shard owns, per table (a checkpoint's sparse part)."""

    def write_state(self, each) -> None:
        """Call ``each(table, rows)`` with ``state_dict``'s tables one at a time, from one
        consistent snapshot, holding only one table's copy of the rows at a time."""

    def load_state_dict(self, state: dict, admission: dict | None = None) -> None:
        """Load rows saved at any world size (each rank keeps the keys it owns)."""

    def admission_state_dict(self) -> dict:
        """Return the admission sketches (a checkpoint's dense part)."""

    def finish_publisher(self, step: int) -> bool:
        """Write the last live rows; return whether they all went out."""


@runtime_checkable
class Table(Protocol):
    """One table's rows on one shard: key → row and optimizer state, by LRU within capacity."""

    name: str
    dim: int
    capacity: int

    def __len__(self) -> int:
        """Return the number of rows held."""

    def lookup(self, keys_U: Any, step: int, out: Any = None) -> Any:
        """Return float32 [U, D] rows of the unique keys (inserting, touching, evicting)."""

    def peek(self, keys_U: Any, init_missing: bool = False, found_out: Any = None) -> Any:
        """Return float32 [U, D] rows of the keys; changes nothing."""

    def apply_gradients(self, keys_U: Any, grads_UD: Any, step: int) -> None:
        """Apply the sparse optimizer to the rows of the unique keys."""

    def counters(self) -> dict[str, int]:
        """Return the table's counters."""

    def state_dict(self) -> Any:
        """Return every row as an Arrow table (key, embedding, state, last_seen)."""

    def load_state_dict(self, rows: Any) -> None:
        """Merge saved rows into the table."""

    def insert_rows(self, rows: Any) -> None:
        """Put rows into the table exactly (a resize's incoming keys)."""

    def pop_rows(self, keys: Any) -> Any:
        """Remove the rows of ``keys`` and return them."""

    def flush(self) -> None:
        """Write pending rows to the tier below (the spill tier), if any."""

    def close(self) -> None:
        """Flush and release the table's resources."""
