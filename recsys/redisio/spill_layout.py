"""The spill tier's Redis layout (``recsys.store.spill.tier`` writes and reads it): the keys, the
values and the owner record of a namespace.

Legend: ``D`` dim.

Keys: ``<namespace>:spill:<table>:<key as 16 lowercase hex digits>`` (the key's uint64
bits). Nothing about the shard or world size enters it, so a row spilled at one world size
is found at any other. ``<namespace>:owner`` names the run that owns the namespace (JSON:
run_dir, job).

Values: raw little-endian bytes, one fixed-size record per row, decoded with
``np.frombuffer`` (no pickle, no JSON)::

    offset  size  field
         0     1  format version (``FORMAT_VERSION``; a reader refuses any other)
         1     1  embedding dtype code: 0 float32, 1 float16
         2     1  optimizer code: 0 rowwise_adagrad, 1 adagrad, 2 adam, 3 sgd
         3     1  reserved (0)
         4     4  dim, uint32
         8     8  key, int64 (checked against the Redis key on read)
        16     8  last_seen, int64
        24  D·2|4 embedding in the storage dtype
         …        optimizer state columns in ``optim.state_columns`` order:
                  per-dim ones D·4 (float32), row-wise ones 4 (float32) or 8 (adam_step, int64)
"""

from __future__ import annotations

import json

import numpy as np

from recsys.store.tables import optim
from recsys.store.config import StoreConfig

FORMAT_VERSION = 1
DTYPE_CODES = {"float32": 0, "float16": 1}
OPTIMIZER_CODES = {"rowwise_adagrad": 0, "adagrad": 1, "adam": 2, "sgd": 3}
HEADER = np.dtype([("version", "u1"), ("dtype", "u1"), ("optimizer", "u1"), ("reserved", "u1"), ("dim", "<u4")])


def spill_prefix(namespace: str, table: str) -> str:
    """Return the prefix of every spill key of ``table``."""
    return f"{namespace}:spill:{table}:"


def spill_key(namespace: str, table: str, key: int) -> str:
    """Return the Redis key of ``key``'s spilled row: world-size and shard independent."""
    return f"{spill_prefix(namespace, table)}{key & 0xFFFFFFFFFFFFFFFF:016x}"


def owner_key(namespace: str) -> str:
    """Return the Redis key naming the run that owns ``namespace`` (JSON: run_dir, job)."""
    return f"{namespace}:owner"


def value_dtype(dim: int, cfg: StoreConfig) -> np.dtype:
    """Return the numpy record type of one spilled row (see the module doc)."""
    emb = "<f4" if cfg.dtype == "float32" else "<f2"
    fields = [(name, HEADER.fields[name][0]) for name in HEADER.names]
    fields += [("key", "<i8"), ("last_seen", "<i8"), ("embedding", emb, (dim,))]
    for c in optim.state_columns(cfg.optimizer):
        t = "<f4" if c.dtype == np.float32 else "<i8"
        fields.append((c.name, t, (dim,)) if c.per_dim else (c.name, t))
    return np.dtype(fields)


def parse_owner(value: bytes | None) -> dict | None:
    """Return the owner record read from ``owner_key`` as a dict (None: there is none)."""
    if value is None:
        return None
    try:
        out = json.loads(value)
    except ValueError:
        return {"unreadable owner record": value[:200].decode("utf-8", "replace")}
    return out if isinstance(out, dict) else {"owner record": out}


def describe_owner(owner: dict) -> str:
    """Return an owner record in words, for an error message."""
    if set(owner) >= {"run_dir", "job"}:
        return f"run directory {owner['run_dir']}, job {owner['job']!r}"
    return ", ".join(f"{k} {v}" for k, v in sorted(owner.items()))
