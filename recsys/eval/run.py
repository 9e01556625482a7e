"""``recsys eval``: score a checkpoint on a Parquet split, streaming, with the training code path.

The checkpoint carries its resolved job config, so only its path is needed. Rows are
read by the same reader (same hashing), embeddings come from the same store (rows loaded
by key; keys never trained read the initial vector a new key would get in training), and
the dense model is the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import numpy as np
import torch

from recsys import config as config_mod
from recsys.eval.metrics import evaluate_predictions


def load_trained(checkpoint: str | Path, device: str = "cpu"):
    """Return (job, store, model) restored from ``checkpoint`` for inference in this process."""
    from recsys.model.arch import RankingModel
    from recsys.store.sharded import ShardedEmbeddingStore
    from recsys.train import checkpoint as ckpt

    path = ckpt.resolve(checkpoint)
    meta = ckpt.load_meta(path)
    job = config_mod.from_dict(config_mod.JobConfig, tomllib.loads(meta["config"]), f"{path}/meta.json:config")
    sparse = ckpt.load_sparse(path, list(job.schema.tables))
    # Inference holds every saved row in memory (spilled ones included: a checkpoint has
    # them all) and touches no Redis, so a table's capacity grows to its saved rows.
    tables = {name: dataclasses.replace(spec, capacity=max(spec.capacity, sparse[name].num_rows))
              for name, spec in job.schema.tables.items()}
    schema = dataclasses.replace(job.schema, tables=tables)
    store = ShardedEmbeddingStore(schema, dataclasses.replace(job.store, spill_url="", device_cache_rows=0),
                                  device=device)
    store.load_state_dict(sparse)
    dims = {t.dim for t in job.schema.tables.values()}
    model = RankingModel(job.model, len(job.schema.dense), len(job.schema.sparse), dims.pop())
    model.load_state_dict(ckpt.load_dense(path)["model"])
    model.to(device).eval()
    return job, store, model, path, meta


@torch.no_grad()
def predict(job, store, model, paths: list[str], batch_size: int | None = None, device: str = "cpu"):
    """Return (labels, probabilities, passthrough columns) for every row of ``paths``, in file order."""
    from recsys.io.reader import ParquetReader

    cfg = dataclasses.replace(job.data.eval, paths=list(paths), shuffle=False,
                              batch_size=batch_size or job.data.eval.batch_size)
    labels, probs = [], []
    extra: dict[str, list[np.ndarray]] = {k: [] for k in cfg.passthrough}
    F = len(job.schema.sparse)
    with ParquetReader(cfg, job.schema) as reader:
        for batch in reader:
            batch = batch.to(device)
            lookup = store.lookup(batch.sparse, None, train=False)
            logits = model(batch.dense, lookup.pooled(F))
            labels.append(batch.labels.cpu().numpy())
            probs.append(torch.sigmoid(logits).cpu().numpy())
            for k in extra:
                extra[k].append(batch.extra[k].cpu().numpy())
    cat = lambda xs: np.concatenate(xs) if xs else np.empty(0)  # noqa: E731
    return cat(labels), cat(probs), {k: cat(v) for k, v in extra.items()}


def evaluate_checkpoint(checkpoint: str | Path, data: list[str] | None = None, device: str = "cpu") -> dict:
    """Return AUC, log loss, NE, calibration and rows of ``checkpoint`` on ``data`` (default: its eval split)."""
    job, store, model, path, meta = load_trained(checkpoint, device)
    paths = data or job.data.eval.paths
    if not paths:
        raise config_mod.ConfigError(f"{path}: the job has no eval paths; pass --data")
    y, p, _ = predict(job, store, model, paths, device=device)
    store.close()
    return {"checkpoint": str(path), "step": meta["step"], "data": list(paths), **evaluate_predictions(y, p)}
