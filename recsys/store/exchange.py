"""The sharded store's all-to-alls between ranks (``W > 1``): keys to their owners, rows
back, gradients to the owners, each one message for all tables (``recsys.store.sharded``
draws the step). ``RankExchange`` is a part of ``ShardedEmbeddingStore``: it uses the
store's ``world_size``, ``rank``, ``group``, ``dim``, ``_comm`` (the exchange counters),
``_lanes`` and its owner-side ``_serve`` / ``_apply``.

Legend: ``W`` world size, ``T`` tables, ``D`` dim, ``U`` keys of one table a rank needs.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from recsys.store.dedup import unique_inverse
from recsys.store.lookup import Lookup, _TablePart
from recsys.store.pooling import scatter_add

__all__ = ["RankExchange"]


class RankExchange:
    """The store's exchange between ranks (see module doc)."""

    def _exchange_keys(self, parts: list[_TablePart]) -> dict:
        """Send every table's keys to their owners; set each part's ``served_U`` (the keys
        this rank owns that some rank asked for) and return the exchange plan."""
        W = self.world_size
        send_counts = np.stack([p.owner_counts for p in parts], axis=1)  # [W, T]
        recv_counts = self._exchange_counts(send_counts)
        # keys leave rank-major, table-minor; ``dest`` is each one's row in rows_all
        starts = [np.concatenate([[0], np.cumsum(p.owner_counts)]) for p in parts]
        blocks = [(p, p.order_U[starts[i][r] : starts[i][r + 1]]) for r in range(W) for i, p in enumerate(parts)]
        send_keys = np.concatenate([p.keys_U[sel] for p, sel in blocks]) if blocks else np.empty(0, np.int64)
        dest = np.concatenate([p.base + sel for p, sel in blocks]) if blocks else np.empty(0, np.int64)
        recv_keys = self._exchange(send_keys, send_counts.sum(1), recv_counts.sum(1), torch.int64, "keys")
        # owner side: each table's requested keys, deduplicated across requesters
        recv_split = _split_rank_table(recv_keys, recv_counts)
        for i, p in enumerate(parts):
            p.served_U, p.served_inverse = unique_inverse(np.concatenate([recv_split[r][i] for r in range(W)]))
        return {"send_counts": send_counts, "recv_counts": recv_counts, "dest": dest}

    def _gather_remote(self, parts: list[_TablePart], comm: dict, rows_np: np.ndarray, step, train: bool) -> None:
        """Fill ``rows_np`` with rows fetched from their owners (keys sent by ``_exchange_keys``)."""
        W, D = self.world_size, self.dim
        send_counts, recv_counts = comm["send_counts"], comm["recv_counts"]
        served = [np.empty((0, D), np.float32)] * len(parts)

        def serve(i: int) -> None:
            p = parts[i]
            served[i] = self._serve(p, p.served_U, step, train)[p.served_inverse]

        todo = [i for i, p in enumerate(parts) if len(p.served_U)]
        self._lanes.each(todo, [len(parts[i].served_U) for i in todo], serve)
        served_split = [np.split(rows, np.cumsum(recv_counts[:, i])[:-1]) for i, rows in enumerate(served)]
        send_rows = np.concatenate([served_split[i][r] for r in range(W) for i in range(len(parts))])
        recv_rows = self._exchange(send_rows.reshape(-1), recv_counts.sum(1) * D, send_counts.sum(1) * D, torch.float32,
                                   "rows")
        rows_np[comm["dest"]] = recv_rows.reshape(-1, D)

    def _push_remote(self, lookup: Lookup, grads: np.ndarray) -> None:
        """Send the row gradients of ``lookup`` to their owners; apply what this rank owns
        (summed over the requesters, / W)."""
        W, D, parts = self.world_size, self.dim, lookup.parts
        send = np.ascontiguousarray(grads[lookup.dest]).reshape(-1)
        recv = self._exchange(send, lookup.send_counts.sum(1) * D, lookup.recv_counts.sum(1) * D, torch.float32,
                              "grads")
        got = _split_rank_table(recv.reshape(-1, D), lookup.recv_counts)

        def apply_served(i: int) -> None:
            p = parts[i]
            g = np.concatenate([got[r][i] for r in range(W)])
            # each rank's loss is a mean over its own rows: the gradients sum over ranks / W
            summed = scatter_add(p.served_inverse, g, np.zeros((len(p.served_U), D), dtype=np.float32), 1.0 / W)
            self._apply(p, p.served_U, summed, lookup.step)

        todo = [i for i, p in enumerate(parts) if len(p.served_U)]
        self._lanes.each(todo, [len(parts[i].served_U) for i in todo], apply_served)

    def _exchange_counts(self, send_counts: np.ndarray) -> np.ndarray:
        if self.world_size == 1:
            return send_counts.copy()
        W, T = send_counts.shape
        out = torch.empty(W * T, dtype=torch.int64)
        t0 = time.perf_counter()
        dist.all_to_all_single(out, torch.from_numpy(send_counts.reshape(-1).astype(np.int64)), group=self.group)
        crossing = (W - 1) * T * 8  # every rank's [T] counts but this rank's own
        self._count_exchange("counts", t0, crossing, crossing)
        return out.numpy().reshape(W, T)

    def _exchange(self, send: np.ndarray, send_sizes: np.ndarray, recv_sizes: np.ndarray, dtype,
                  kind: str) -> np.ndarray:
        if self.world_size == 1:
            return send
        out = torch.empty(int(recv_sizes.sum()), dtype=dtype)
        src = torch.from_numpy(np.ascontiguousarray(send)).to(dtype)
        t0 = time.perf_counter()
        dist.all_to_all_single(
            out,
            src,
            output_split_sizes=[int(x) for x in recv_sizes],
            input_split_sizes=[int(x) for x in send_sizes],
            group=self.group,
        )
        # bytes that cross to other ranks (a rank's block to itself is a local copy)
        itemsize = out.element_size()
        sent = (int(send_sizes.sum()) - int(send_sizes[self.rank])) * itemsize
        received = (int(recv_sizes.sum()) - int(recv_sizes[self.rank])) * itemsize
        self._count_exchange(kind, t0, sent, received)
        return out.numpy()

    def _count_exchange(self, kind: str, t0: float, sent: int, received: int) -> None:
        c = self._comm.setdefault(kind, {"calls": 0, "seconds": 0.0, "bytes_sent": 0, "bytes_received": 0})
        c["calls"] += 1
        c["seconds"] += time.perf_counter() - t0
        c["bytes_sent"] += sent
        c["bytes_received"] += received

    def comm_stats(self) -> dict[str, dict]:
        """Return this rank's all-to-alls so far, per kind (``counts``, ``keys``, ``rows``,
        ``grads``): calls, seconds inside the call (the transfer and any wait for the other
        ranks to arrive) and bytes sent to / received from other ranks."""
        return {k: dict(v) for k, v in self._comm.items()}



def _split_rank_table(buf: np.ndarray, sizes_WT: np.ndarray) -> list[list[np.ndarray]]:
    """Return ``buf`` cut into [rank][table] blocks of the given sizes (rank-major order)."""
    ends = np.cumsum(sizes_WT.reshape(-1))
    pieces = np.split(buf, ends[:-1]) if len(ends) else []
    W, T = sizes_WT.shape
    return [pieces[r * T : (r + 1) * T] for r in range(W)]
