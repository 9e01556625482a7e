"""Shared by the store tests: a three-feature schema, random KJTs and a short training run."""

from __future__ import annotations

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.features.schema import FeatureSpec, Schema, TableSpec


def three_feature_schema(dim: int, capacity: int) -> Schema:
    """Return user and item single-hot features plus a mean-pooled item history bag."""
    return Schema(
        dense=["d"],
        tables={"user": TableSpec(dim=dim, capacity=capacity), "item": TableSpec(dim=dim, capacity=capacity)},
        sparse=[FeatureSpec(name="user"), FeatureSpec(name="item"),
                FeatureSpec(name="history", table="item", multi_hot=True, pooling="mean")],
    )


def random_kjts(steps: int, vocab: int, seed: int, B: int = 8) -> list[KeyedJaggedTensor]:
    """Return ``steps`` KJTs of B rows over ids ``0..vocab-1`` (history bags of 0..3 ids)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = np.concatenate([np.ones(B), np.ones(B), rng.integers(0, 4, B)]).astype(np.int32)
        values = rng.integers(0, vocab, int(lengths.sum()))
        out.append(KeyedJaggedTensor(keys=["user", "item", "history"], values=torch.from_numpy(values),
                                     lengths=torch.from_numpy(lengths)))
    return out


def train_pooled(store, kjts, dim: int) -> list[torch.Tensor]:
    """Return each step's pooled output of a short training run on ``store`` (then flush)."""
    V = torch.linspace(-1, 1, 3 * dim).view(1, 3, dim).to(store.device)
    pooled_all = []
    for step, kjt in enumerate(kjts):
        lookup = store.lookup(kjt, step)
        pooled = lookup.pooled(3)
        ((pooled * V).sum() / kjt.stride() + (pooled**2).sum()).backward()
        store.push(lookup)
        pooled_all.append(pooled.detach())
    store.flush()
    return pooled_all
