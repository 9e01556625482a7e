"""A lookup of the sharded store (``recsys.store.sharded.store``): what it knows from its batch
(``_Prepared``), each table's share (``_TablePart``), and the result the trainer pools and
pushes (``Lookup``).

Legend: ``B`` rows in the batch, ``F`` features, ``U`` unique keys of one table in the
batch, ``D`` table dim, ``W`` world size, ``T`` tables.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from recsys.store.tables.pooling import local_copy, pool_backward, pool_forward, pool_torch
from recsys.runtime.transfer import arrive

__all__ = ["Lookup"]


@dataclasses.dataclass(slots=True)
class _TablePart:
    """One table's share of a lookup: what this rank asked for and what it served."""

    name: str
    keys_U: np.ndarray  # unique keys this rank needs (int64), first-appearance order
    base: int  # first row of this table in Lookup.rows_all
    # owner side (W > 1): keys received for this table, deduplicated (a view of the
    # exchange's served keys of all tables: ``RankExchange.send_keys``)
    served_U: np.ndarray | None = None
    # this rank's slots of the keys it serves (keys_U, or served_U when W > 1), when its
    # table reserved them early (``EmbeddingTable.reserve``) or a device tier gave them
    # (``lookup_slots``); also the push's slot hints, used unchecked if the table's
    # ``departures`` is still the count right after
    slots: np.ndarray | None = None
    departures: int | None = None


@dataclasses.dataclass(slots=True)
class _Prepared:
    """What a lookup knows from the batch alone (``ShardedEmbeddingStore._prepare``)."""

    batch_size: int
    parts: list[_TablePart]  # keys_U and base of every table
    num_rows: int  # sum of U over tables: the zero row's index
    single_idx: torch.Tensor
    multi_values: torch.Tensor
    multi_offsets: torch.Tensor
    multi_weights: torch.Tensor | None
    route: tuple | None = None  # W > 1: (send_keys, dest, send_counts [W, T]) (``exchange.route``)
    # the unique keys this rank reserves and serves, all tables: (keys, base [T + 1]); the
    # batch's (W = 1, ``uniq``) or the served ones (W > 1, set by the exchange)
    owned: tuple | None = None
    fused: list[int] | None = None  # tables whose training work a ``TableGroup`` does
    slots: np.ndarray | None = None  # their slots, at the owned keys' places
    reserved: bool = False  # ``_reserve`` ran: keys exchanged (W > 1), slots taken
    comm: dict = dataclasses.field(default_factory=dict)  # the exchange plan (W > 1)


@dataclasses.dataclass(slots=True)
class _Failed:
    """A lookup whose early preparation raised (re-raised when the lookup runs)."""

    exc: Exception


@dataclasses.dataclass(slots=True)
class Lookup:
    """The result of ``lookup``: the batch's rows of every table, ready for pooling and push.

    ``rows_all`` is one leaf tensor [sum of U over tables + 1, D]: table t's unique keys
    occupy rows ``parts[t].base ..`` and the last row is a constant zero row that empty
    bags point at (it never gets a gradient).
    """

    step: int | None
    batch_size: int
    parts: list[_TablePart]
    rows_all: torch.Tensor
    single_idx: torch.Tensor  # [B, F_single] row of each single-hot feature's id (pad if none)
    single_cols: torch.Tensor  # [F_single] schema position of each single-hot feature
    multi_values: torch.Tensor  # rows of multi-hot ids, bags feature-major
    multi_offsets: torch.Tensor  # [F_multi * B + 1]
    multi_weights: torch.Tensor | None  # per-id weights: 1/len for mean pooling, given ones for weighted features
    multi_cols: torch.Tensor  # [F_multi] schema position of each multi-hot feature
    pooled_leaf: torch.Tensor | None = None  # [B, F, D] pooled on CPU by pool_now(), a leaf
    send_counts: np.ndarray | None = None  # [W, T] keys sent to each owner, per table
    recv_counts: np.ndarray | None = None  # [W, T] keys received from each requester
    dest: np.ndarray | None = None  # rows_all row of each key in the exchange order
    served_base: np.ndarray | None = None  # [T + 1] each table's first served key (owner side)
    served_inverse: np.ndarray | None = None  # served key of each received key, received order
    fused: list[int] | None = None  # tables whose push a ``TableGroup`` applies (``_Prepared.fused``)
    fused_slots: np.ndarray | None = None  # their slots (``_Prepared.slots``)
    owned_base: np.ndarray | None = None  # [T + 1] each table's first owned key (``_Prepared.owned``)
    ready: object = None  # torch.cuda.Event: the tensors' copy to the device is done after it (None: done)

    @property
    def rows(self) -> dict[str, torch.Tensor]:
        """Return each table's [U, D] rows (views of ``rows_all``)."""
        return {p.name: self.rows_all[p.base : p.base + len(p.keys_U)] for p in self.parts}

    def pooled(self, num_features: int | None = None) -> torch.Tensor:
        """Return pooled embeddings [B, F, D] in schema feature order.

        On CPU: one numba pass (``pool_now``), returned as a leaf tensor whose gradient
        ``push`` turns into row gradients on the store's worker, off the caller's thread.
        (Pooling on the worker instead was measured slower at staleness 0: it lengthens
        the wait for the next lookup.) On other devices: torch kernels on ``rows_all``,
        with autograd. Either way ``push`` takes the gradients of ``pooled()`` and of
        ``rows_all`` (if any) together.
        """
        if self.ready is not None:  # the caller's stream waits for the rows' copy, its thread does not
            arrive([self.rows_all, self.single_idx, self.multi_values, self.multi_offsets, self.multi_weights],
                   self.ready)
            self.ready = None
        if self.pooled_leaf is None and self.rows_all.device.type == "cpu":
            self.pool_now()
        out = self.pooled_leaf
        if out is None:
            out = pool_torch(self.rows_all, self.single_idx, self.single_cols, self.multi_values,
                             self.multi_offsets, self.multi_weights, self.multi_cols)
        if num_features is not None and out.shape[1] != num_features:
            raise ValueError(f"pooled: {out.shape[1]} features, caller expected {num_features}")
        return out

    def pool_now(self) -> None:
        """Compute ``pooled_leaf`` from ``rows_all`` (CPU float32) with the numba kernel."""
        w = self.multi_weights
        F = self.single_cols.shape[0] + self.multi_cols.shape[0]
        out = torch.empty((self.batch_size, F, self.rows_all.shape[1]), dtype=torch.float32)
        rows = local_copy(self.rows_all.detach().numpy())  # read from this core's cache, not the gatherer's
        pool_forward(rows, self.single_idx.numpy(), self.single_cols.numpy(), self.multi_values.numpy(),
                     self.multi_offsets.numpy(), None if w is None else w.numpy(), self.multi_cols.numpy(), out.numpy())
        self.pooled_leaf = out.requires_grad_(self.rows_all.requires_grad)

    def pool_backward(self, grad_BFD: np.ndarray, out_RD: np.ndarray, columns: np.ndarray | None = None) -> None:
        """Add the row gradients of ``pooled_leaf``'s upstream gradient into ``out_RD``
        (``columns``, bool [F]: of those feature columns only)."""
        w = self.multi_weights
        pool_backward(grad_BFD, self.single_idx.numpy(), self.single_cols.numpy(), self.multi_values.numpy(),
                      self.multi_offsets.numpy(), None if w is None else w.numpy(), self.multi_cols.numpy(),
                      out_RD, columns)
