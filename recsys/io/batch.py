"""The batch the reader yields and the trainer consumes.

Shapes (legend: ``B`` rows in the batch, ``N`` dense columns, ``F`` sparse features)::

    Batch
    ├── dense    float32 [B, N]      transformed dense columns, schema order
    ├── labels   float32 [B]
    ├── weights  float32 [B] or None  per-example weights (schema.weight), None without one
    ├── sparse   KeyedJaggedTensor   keys = F feature names (schema order)
    │              values  int64 [sum of lengths]   hashed 64-bit keys, feature-major
    │              lengths int32 [F * B]            bag size per (feature, row)
    └── extra    {column: Tensor [B]}               passthrough columns (e.g. row_id)

No validation here: it is on the hot path; the reader validates.

Host and device: ``to(device)`` moves what the dense model reads (dense, labels, weights,
passthrough columns); ``sparse`` always stays on the host, where the embedding store hashes
its keys to slots (docs/ARCHITECTURE.md, "The host/device boundary").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass(slots=True)
class Batch:
    """One batch of rows: dense features, labels, hashed sparse ids and passthrough columns."""

    dense: torch.Tensor
    labels: torch.Tensor
    sparse: KeyedJaggedTensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Rows in the batch."""
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """Return the batch with its dense inputs, labels, weights and passthrough columns on
        ``device``; the sparse ids stay on the host, where the store works on them (it refuses
        ids on another device). Returns itself if those tensors are there already: the
        trainer calls this every step, and on CPU a dozen no-op torch calls on its thread are
        time its other torch threads wait."""
        dev = torch.device(device)
        moved = [self.dense, self.labels, *self.extra.values()] + ([] if self.weights is None else [self.weights])
        if all(t.device == dev for t in moved):
            return self
        return Batch(
            dense=self.dense.to(dev, non_blocking=non_blocking),
            labels=self.labels.to(dev, non_blocking=non_blocking),
            sparse=self.sparse,
            extra={k: v.to(dev, non_blocking=non_blocking) for k, v in self.extra.items()},
            weights=None if self.weights is None else self.weights.to(dev, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "Batch":
        """Return the batch with the tensors ``to`` moves in pinned host memory (for
        asynchronous copies to a GPU); the sparse ids stay where they are."""
        return Batch(
            dense=self.dense.pin_memory(),
            labels=self.labels.pin_memory(),
            sparse=self.sparse,
            extra={k: v.pin_memory() for k, v in self.extra.items()},
            weights=None if self.weights is None else self.weights.pin_memory(),
        )


def empty_batch(schema, extra: list[str]) -> Batch:
    """Return a zero-row batch (what a rank feeds once its data ran out)."""
    F = len(schema.sparse)
    kjt = KeyedJaggedTensor(
        keys=schema.feature_names,
        values=torch.empty(0, dtype=torch.int64),
        lengths=torch.empty(0, dtype=torch.int32),
        stride=0,
        length_per_key=[0] * F,
        offset_per_key=[0] * (F + 1),
    )
    return Batch(
        dense=torch.empty(0, len(schema.dense)),
        labels=torch.empty(0),
        sparse=kjt,
        extra={k: torch.empty(0, dtype=torch.int64) for k in extra},
        weights=torch.empty(0) if schema.weight else None,
    )
