"""Scoring a checkpoint: load it and stream its predictions on Parquet files, with the training
code path (what ``recsys eval``, ``recsys/eval/evaluate.py``, builds its report on).

The checkpoint carries its resolved job config, so only its path is needed. Rows are
read by the same reader (same hashing), embeddings come from the same store (rows loaded
by key; keys never trained read the initial vector a new key would get in training), and
the dense model is the checkpoint's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from recsys import config as config_mod
from recsys.errors import UserError
from recsys.eval.metrics import evaluate_predictions
from recsys.store.config import DeviceConfig


class PeerStopped(UserError):
    """This rank stopped because another rank of ``iter_predictions`` met bad input."""


def dense_stats_of(job, meta: dict, path) -> "DenseStats | None":
    """Return the checkpoint's dense statistics (None when its schema's transforms read
    none); a UserError when its transforms need them and it has none."""
    from recsys.features.dense import DenseStats

    if not job.schema.needs_dense_stats:
        return None
    saved = meta.get("dense_stats")
    if saved is None:
        kinds = sorted({job.schema.transform_of(c) for c in job.schema.dense} - {"none", "signed_log1p"})
        raise UserError(f"{path}/meta.json: schema.dense_transform uses {kinds}, which need the training data's "
                        "dense statistics, but the checkpoint has none (expected meta.json[\"dense_stats\"], "
                        "written by every save of a run with such transforms)")
    try:
        return DenseStats.from_json(saved, f"{path}/meta.json:dense_stats")
    except ValueError as exc:
        raise UserError(str(exc)) from None


def load_trained(checkpoint: str | Path, device: str = "cpu"):
    """Return (job, store, model) restored from ``checkpoint`` for inference in this process."""
    from recsys.model.arch import model_for
    from recsys.store.tables import wide
    from recsys.store.tables.wide import table_names
    from recsys.store.sharded.store import ShardedEmbeddingStore
    from recsys.checkpoint import read as ckpt

    path = ckpt.resolve(checkpoint)
    meta = ckpt.load_meta(path)
    job = config_mod.saved_job(meta["config"], f"{path}/meta.json:config")  # e.g. a DeepFM saved before deepfm_dense
    dense_stats_of(job, meta, path)  # a checkpoint without the statistics its transforms need fails here
    sparse = ckpt.load_sparse(path, table_names(job.schema, job.model.wide))
    # Inference holds every saved row in memory (spilled ones included: a checkpoint has
    # them all) and touches no Redis, so a table's capacity grows to its saved rows.
    def inference_store(schema, cfg):
        tables = {name: dataclasses.replace(spec, capacity=max(spec.capacity, sparse[name].num_rows))
                  for name, spec in schema.tables.items()}
        store = ShardedEmbeddingStore(dataclasses.replace(schema, tables=tables),
                                      dataclasses.replace(cfg, spill=dataclasses.replace(cfg.spill, url=""),
                                                          device=DeviceConfig()),
                                      device=device)
        store.load_state_dict({name: sparse[name] for name in tables})
        return store

    store = inference_store(job.schema, job.store)
    if job.model.wide:
        store = wide.WideStore(store, inference_store(wide.wide_schema(job.schema),
                                                      wide.wide_store_config(job.store, job.model)))
    model = model_for(job)
    model.load_state_dict(ckpt.load_dense(path)["model"])
    model.to(device).eval()
    return job, store, model, path, meta


@torch.no_grad()
def iter_predictions(job, store, model, paths: list[str], *, batch_size: int | None = None, device: str = "cpu",
                     passthrough: list[str] | None = None, rank: int = 0, world_size: int = 1,
                     dense_stats=None):
    """Yield (labels, probabilities, weights, {passthrough column: values}) per batch of ``paths``.

    ``weights`` are the rows' sample weights (``schema.weight``), None when the job has none.
    ``dense_stats``: the checkpoint's dense statistics (``dense_stats_of``), for the transforms
    that read them.

    One process reads every row in file order. With ``world_size`` > 1 (a process group
    is up and ``store`` is sharded over it) this rank reads its exactly-once share and the
    ranks stay in step (a rank whose data ran out feeds empty batches to the store's
    collectives until every rank is done). A rank meeting bad input (UserError) stops every
    rank in the same step: it raises its error, the others ``PeerStopped``.
    """
    import torch.distributed as dist

    from recsys.io.reader import ParquetReader
    from recsys.io.batch import empty_batch
    from recsys.model.arch import model_inputs

    extra_cols = list(job.data.eval.passthrough if passthrough is None else passthrough)
    cfg = dataclasses.replace(job.data.eval, paths=list(paths), shuffle=False, passthrough=extra_cols,
                              batch_size=batch_size or job.data.eval.batch_size,
                              num_workers=0 if world_size == 1 else job.data.eval.num_workers)
    F = len(job.schema.sparse)
    with ParquetReader(cfg, job.schema, rank=rank, world_size=world_size, dense_stats=dense_stats) as reader:
        it = iter(reader)
        while True:
            try:
                batch, bad = next(it, None), None
            except UserError as exc:  # bad data in this rank's share
                if world_size == 1:
                    raise
                batch, bad = None, exc
            if world_size > 1:
                flag = torch.tensor([int(batch is not None), int(bad is not None)], dtype=torch.int64)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if bad is not None:
                    raise bad
                if flag[1].item():
                    raise PeerStopped("another rank stopped on bad input")
                if not flag[0].item():
                    break
                cur = batch or empty_batch(job.schema, extra_cols)
            elif batch is None:
                break
            else:
                cur = batch
            host, cur = cur, cur.to(device)  # labels, weights and ids are read from the host batch
            lookup = store.lookup(host.sparse, None, train=False)
            logits = model(cur.dense, *model_inputs(lookup, F))
            if batch is not None:
                yield (host.labels.numpy(), torch.sigmoid(logits).cpu().numpy(),
                       None if host.weights is None else host.weights.numpy(),
                       {k: host.extra[k].numpy() for k in extra_cols})


def predict(job, store, model, paths: list[str], batch_size: int | None = None, device: str = "cpu",
            dense_stats=None):
    """Return (labels, probabilities, weights or None, passthrough columns) for every row of
    ``paths``, in file order."""
    labels, probs, weights = [], [], []
    extra: dict[str, list[np.ndarray]] = {k: [] for k in job.data.eval.passthrough}
    for y, p, w, ex in iter_predictions(job, store, model, paths, batch_size=batch_size, device=device,
                                        dense_stats=dense_stats):
        labels.append(y)
        probs.append(p)
        weights.append(w)
        for k in extra:
            extra[k].append(ex[k])
    cat = lambda xs: np.concatenate(xs) if xs else np.empty(0)  # noqa: E731
    return (cat(labels), cat(probs), cat(weights) if job.schema.weight else None,
            {k: cat(v) for k, v in extra.items()})


def evaluate_checkpoint(checkpoint: str | Path, data: list[str] | None = None, device: str = "cpu") -> dict:
    """Return AUC, log loss, NE, calibration and rows of ``checkpoint`` on ``data`` (default: its eval split),
    weighted by the job's ``schema.weight`` when it has one."""
    job, store, model, path, meta = load_trained(checkpoint, device)
    paths = data or job.data.eval.paths
    if not paths:
        raise config_mod.ConfigError(f"{path}: the job has no eval paths; pass --data")
    y, p, w, _ = predict(job, store, model, paths, device=device, dense_stats=dense_stats_of(job, meta, path))
    store.close()
    return {"checkpoint": str(path), "step": meta["step"], "data": list(paths), **evaluate_predictions(y, p, w)}
