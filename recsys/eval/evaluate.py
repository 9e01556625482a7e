"""``recsys eval`` with everything: slices, predictions file, plots, comparison, several processes.

::

    checkpoint(s) ─► load_trained ─► iter_predictions (reader → store → model; one process,
                                     or N ranks with the reader's exactly-once sharding, gloo)
        rows ─► labels, scores (+ slice columns, id columns)
              ├─► summarize: AUC (exact), log loss, NE, calibration, CTR, ECE, table
              ├─► per --slice column: the top-k values by rows, then "other" (a partition)
              ├─► --predictions OUT.parquet   (ids, label, score) per row
              ├─► --plots DIR                 ROC, calibration, score histograms, slice AUCs
              └─► --compare B                 B's metrics on the same rows, deltas, DeLong CI

Every prediction is kept in memory up to ``max_exact_rows`` rows (``metrics.MAX_EXACT_ROWS``
by default) so the AUC is exact. A single process evaluating more rows than that switches to
``metrics.StreamingMetrics`` (binned AUC with its error bound stated in the result);
slices, plots, comparison and several processes need every row and fail with a clear error.

Slice columns: with one process any column of the data (any type, nulls are a value of
their own), read next to the reader in file order. With several processes the reader
carries them (passthrough), so they must be integer, boolean or float columns without nulls.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from recsys.errors import UserError
from recsys.eval import metrics as M

OTHER = "other"


@dataclasses.dataclass
class EvalOptions:
    """What ``recsys eval`` computes besides the headline metrics."""

    data: list[str] | None = None
    slices: list[str] = dataclasses.field(default_factory=list)
    top_k: int = 10
    predictions: Path | None = None
    plots: Path | None = None
    compare: Path | None = None
    nproc: int = 1
    max_exact_rows: int | None = M.MAX_EXACT_ROWS
    calibration_bins: int = 10
    device: str = "cpu"


@dataclasses.dataclass
class Scored:
    """Every row one checkpoint scored: labels, scores, id columns and slice columns."""

    checkpoint: str
    step: int
    labels: np.ndarray
    scores: np.ndarray
    ids: dict[str, np.ndarray]
    slices: dict[str, object]  # column -> pyarrow Array (one process) or numpy array


# --------------------------------------------------------------------------- columns


def data_columns(paths: list[str]) -> tuple[list, dict]:
    """Return (files in reader order, {column: arrow type}) of the data, checking every file has them."""
    import pyarrow.parquet as pq

    from recsys.io.units import expand_paths

    files = expand_paths(paths)
    if not files:
        raise UserError(f"no Parquet files under {paths}")
    types: dict = {}
    for sf in files:
        schema = pq.read_schema(sf.path, filesystem=sf.filesystem)
        for field in schema:
            types.setdefault(field.name, field.type)
    return files, types


def check_slices(slices: list[str], types: dict, nproc: int) -> None:
    """Raise UserError naming a slice column the data lacks (or one several processes cannot carry)."""
    import pyarrow as pa

    for col in slices:
        if col not in types:
            shown = ", ".join(list(types)[:40])
            raise UserError(f"--slice {col}: no such column in the data (columns: {shown})")
        t = types[col]
        if nproc > 1 and not (pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t)):
            raise UserError(f"--slice {col} with --nproc {nproc}: the column is {t}; several processes can slice "
                            "only by integer, boolean or float columns without nulls (use --nproc 1 for any column)")


def read_columns(files, columns: list[str], rows: int) -> dict:
    """Return ``columns`` of ``files`` concatenated in reader order (one process, no shuffle)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    for col in columns:
        parts = [pq.read_table(sf.path, columns=[col], filesystem=sf.filesystem).column(col) for sf in files]
        arr = pa.chunked_array([c for p in parts for c in p.chunks], type=parts[0].type).combine_chunks()
        if len(arr) != rows:
            raise UserError(f"--slice {col}: the files hold {len(arr)} rows but {rows} were scored "
                            "(a bad file skipped by on_bad_file?); cannot line the column up with the rows")
        out[col] = arr
    return out


# --------------------------------------------------------------------------- scoring


def _collect(batches, max_rows: int, need_rows: str | None, calibration_bins: int):
    """Return (labels, scores, extras) or, past ``max_rows`` rows, (None, StreamingMetrics, extras=None)."""
    ys, ps, ex = [], [], {}
    n, stream = 0, None
    for y, p, extra in batches:
        if stream is not None:
            stream.add(y, p)
            continue
        ys.append(y), ps.append(p)
        for k, v in extra.items():
            ex.setdefault(k, []).append(v)
        n += y.size
        if n > max_rows:
            if need_rows:
                raise UserError(f"more than {max_rows:,} rows: {need_rows} needs every prediction in memory; "
                                "raise --max-exact-rows or evaluate fewer rows")
            stream = M.StreamingMetrics()
            for a, b in zip(ys, ps):
                stream.add(a, b)
            ys = ps = ex = None
    if stream is not None:
        return None, stream, None
    cat = lambda xs: np.concatenate(xs) if xs else np.empty(0)  # noqa: E731
    return cat(ys), cat(ps), {k: cat(v) for k, v in ex.items()}


def _predictions_writer(out: Path | None):
    """Return (write(ids, labels, scores), close()) streaming rows to ``out`` (Parquet)."""
    if out is None:
        return (lambda *a: None), (lambda: None)
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.parent.mkdir(parents=True, exist_ok=True)
    state = {"writer": None, "row": 0}

    def write(ids: dict, y: np.ndarray, p: np.ndarray) -> None:
        cols = dict(ids) if ids else {"row_id": np.arange(state["row"], state["row"] + y.size, dtype=np.int64)}
        state["row"] += y.size
        table = pa.table({**cols, "label": y.astype(np.int8), "score": p.astype(np.float32)})
        if state["writer"] is None:
            state["writer"] = pq.ParquetWriter(str(out), table.schema, compression="zstd")
        state["writer"].write_table(table)

    def close() -> None:
        if state["writer"] is None:  # no rows: still a valid, empty file
            pq.write_table(pa.table({"row_id": pa.array([], pa.int64()), "label": pa.array([], pa.int8()),
                                     "score": pa.array([], pa.float32())}), str(out))
        else:
            state["writer"].close()

    return write, close


def score_one_process(checkpoint, paths, id_cols, passthrough, opts: EvalOptions, need_rows: str | None,
                      predictions: Path | None = None):
    """Score every row of ``paths`` in this process; return (Scored or None, StreamingMetrics or None)."""
    from recsys.eval.run import iter_predictions, load_trained

    job, store, model, path, meta = load_trained(checkpoint, opts.device)
    write, close = _predictions_writer(predictions)
    try:
        def batches():
            for y, p, extra in iter_predictions(job, store, model, paths, device=opts.device,
                                                passthrough=passthrough):
                write({k: extra[k] for k in id_cols}, y, p)
                yield y, p, extra
        y, p, extra = _collect(batches(), opts.max_exact_rows, need_rows, opts.calibration_bins)
    finally:
        close()
        store.close()
    if y is None:
        return None, p, str(path), meta["step"]
    return Scored(str(path), meta["step"], y, p, {k: extra[k] for k in id_cols},
                  {k: extra[k] for k in passthrough if k not in id_cols}), None, str(path), meta["step"]


def _rank_scores(rank: int, world_size: int, checkpoint: str, paths: list[str], passthrough: list[str], device: str):
    """One rank of ``--nproc``: score this rank's share; rank 0 returns everyone's rows."""
    import torch.distributed as dist

    from recsys.eval.run import iter_predictions, load_trained

    job, store, model, path, meta = load_trained(checkpoint, device)
    try:
        parts = list(iter_predictions(job, store, model, paths, device=device, passthrough=passthrough,
                                      rank=rank, world_size=world_size))
    finally:
        store.close()
    cat = lambda xs: np.concatenate(xs) if xs else np.empty(0)  # noqa: E731
    mine = (cat([a for a, _, _ in parts]), cat([b for _, b, _ in parts]),
            {k: cat([e[k] for _, _, e in parts]) for k in passthrough})
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None
    y = np.concatenate([g[0] for g in gathered])
    p = np.concatenate([g[1] for g in gathered])
    extra = {k: np.concatenate([g[2][k] for g in gathered]) for k in passthrough}
    return str(path), meta["step"], y, p, extra


def score_processes(checkpoint, paths, id_cols, passthrough, opts: EvalOptions) -> Scored:
    """Score ``paths`` with ``opts.nproc`` gloo processes, each reading its exactly-once share."""
    from recsys.spawn import run_gloo

    results = run_gloo(_rank_scores, opts.nproc, str(checkpoint), list(paths), list(passthrough), opts.device,
                       error=UserError)
    path, step, y, p, extra = results[0]
    if y.size > opts.max_exact_rows:
        raise UserError(f"more than {opts.max_exact_rows:,} rows: --nproc needs every prediction in memory; "
                        "raise --max-exact-rows or use --nproc 1 (binned AUC)")
    return Scored(path, step, y, p, {k: extra[k] for k in id_cols},
                  {k: extra[k] for k in passthrough if k not in id_cols})


# --------------------------------------------------------------------------- slices


def slice_groups(values, top_k: int) -> tuple[list, np.ndarray]:
    """Return (group names, group index per row): the ``top_k`` values by rows, then ``other``.

    Groups partition the rows: every row is in exactly one. A null is a value (``None``).
    Ties in volume are broken by the value's text, so the order is stable.
    """
    import pyarrow as pa

    arr = values if isinstance(values, pa.Array) else pa.array(values)
    enc = arr.dictionary_encode()
    codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    names = enc.dictionary.to_pylist() + [None]
    codes = np.where(codes < 0, len(names) - 1, codes)
    counts = np.bincount(codes, minlength=len(names))
    present = [c for c in np.flatnonzero(counts)]
    present.sort(key=lambda c: (-counts[c], str(names[c])))
    top = present[:top_k]
    group_of = np.full(len(names), len(top), dtype=np.int64)
    group_of[top] = np.arange(len(top))
    groups = [_jsonable(names[c]) for c in top] + ([OTHER] if len(present) > len(top) else [])
    return groups, group_of[codes]


def _jsonable(v):
    return v.item() if isinstance(v, np.generic) else v


def slice_metrics(y: np.ndarray, p: np.ndarray, values, top_k: int, calibration_bins: int) -> list[dict]:
    """Return the metrics of each slice group (see ``slice_groups``), calibration tables left out."""
    groups, idx = slice_groups(values, top_k)
    out = []
    for g, name in enumerate(groups):
        rows = idx == g
        m = M.summarize(y[rows], p[rows], calibration_bins)
        m.pop("calibration_table", None)
        out.append({"value": name, **m})
    return out


# --------------------------------------------------------------------------- the command


def run_eval(checkpoint, opts: EvalOptions) -> dict:
    """Return the result of ``recsys eval`` (and write its files); see the module doc."""
    if opts.max_exact_rows is None:
        opts = dataclasses.replace(opts, max_exact_rows=M.MAX_EXACT_ROWS)
    from recsys import checkpoint_files
    from recsys.config import ConfigError

    path = checkpoint_files.resolve(checkpoint)
    job = _job_of(path)
    paths = opts.data or job.data.eval.paths
    if not paths:
        raise ConfigError(f"{path}: the job has no eval paths; pass --data")
    if opts.nproc < 1:
        raise UserError(f"--nproc must be at least 1, found {opts.nproc}")
    files, types = data_columns(paths)
    check_slices(opts.slices, types, opts.nproc)
    id_cols = [c for c in job.data.eval.passthrough if c in types]
    need = [flag for flag, on in (("--slice", opts.slices), ("--plots", opts.plots), ("--compare", opts.compare))
            if on]
    need_rows = "/".join(need) or None
    if opts.nproc == 1:
        scored, stream, ck, step = score_one_process(path, paths, id_cols, id_cols, opts, need_rows, opts.predictions)
        if scored is not None and opts.slices:
            scored.slices = read_columns(files, opts.slices, scored.labels.size)
    else:
        passthrough = id_cols + [c for c in opts.slices if c not in id_cols]
        scored = score_processes(path, paths, id_cols, passthrough, opts)
        scored.slices = {c: (scored.ids[c] if c in id_cols else scored.slices[c]) for c in opts.slices}
        stream, ck, step = None, scored.checkpoint, scored.step
        if opts.predictions is not None:
            write, close = _predictions_writer(opts.predictions)
            write(scored.ids, scored.labels, scored.scores)
            close()
    result = {"checkpoint": ck, "step": step, "data": list(paths)}
    if scored is None:
        result.update(stream.result(opts.calibration_bins))
        return result
    result.update(M.summarize(scored.labels, scored.scores, opts.calibration_bins))
    result["nproc"] = opts.nproc
    if opts.slices:
        result["slices"] = {c: slice_metrics(scored.labels, scored.scores, scored.slices[c], opts.top_k,
                                             opts.calibration_bins) for c in opts.slices}
    if opts.predictions is not None:
        result["predictions"] = str(opts.predictions)
    if opts.compare is not None:
        result["compare"] = compare(scored, opts, paths, types)
    if opts.plots is not None:
        from recsys.eval.plots import write_plots

        result["plots"] = [str(p) for p in write_plots(opts.plots, scored, result)]
    return result


def compare(a: Scored, opts: EvalOptions, paths, types) -> dict:
    """Score the same rows with ``opts.compare``; return its metrics, the deltas and the DeLong CI."""
    from recsys import checkpoint_files

    path_b = checkpoint_files.resolve(opts.compare)
    job_b = _job_of(path_b)
    ids_b = [c for c in job_b.data.eval.passthrough if c in types]
    one = dataclasses.replace(opts, predictions=None)
    if opts.nproc == 1:
        b, _, _, _ = score_one_process(path_b, paths, ids_b, ids_b, one, "--compare")
    else:
        b = score_processes(path_b, paths, ids_b, ids_b, one)
    if b.labels.shape != a.labels.shape or not np.array_equal(b.labels, a.labels):
        raise UserError(f"--compare: {path_b} read the rows in another order or count than {a.checkpoint} "
                        f"({b.labels.size} vs {a.labels.size} rows); cannot pair them")
    mb = M.summarize(b.labels, b.scores, opts.calibration_bins)
    ma = M.summarize(a.labels, a.scores, opts.calibration_bins)
    keys = ("auc", "log_loss", "normalized_entropy", "calibration", "ece", "ctr", "predicted_ctr", "rows", "positives")
    out = {"checkpoint": b.checkpoint, "step": b.step,
           "metrics": {k: mb[k] for k in keys if k in mb},
           "delta": {k: mb[k] - ma[k] for k in keys if k in ma and k in mb}}
    try:
        out["auc_diff"] = M.delong_auc_diff(a.labels, a.scores, b.scores)
    except ValueError as exc:
        out["auc_diff"] = {"error": str(exc)}
    return out


def _job_of(path: Path):
    import tomllib

    from recsys import checkpoint_files
    from recsys import config as config_mod

    meta = checkpoint_files.load_meta(path)
    return config_mod.from_dict(config_mod.JobConfig, tomllib.loads(meta["config"]), f"{path}/meta.json:config")


# --------------------------------------------------------------------------- text tables


def format_tables(result: dict) -> str:
    """Return the human-readable tables of a result: slices and the comparison."""
    lines = []
    cols = ("rows", "positives", "ctr", "auc", "log_loss", "normalized_entropy", "calibration")
    head = f"{'value':<24}" + "".join(f"{c[:12]:>14}" for c in cols)
    for col, groups in result.get("slices", {}).items():
        lines += ["", f"slice {col}", head]
        for g in groups:
            lines.append(f"{str(g['value'])[:23]:<24}" + "".join(_cell(g.get(c)) for c in cols))
    cmp = result.get("compare")
    if cmp:
        lines += ["", f"{'metric':<20}{'A':>14}{'B':>14}{'B - A':>14}",]
        lines.append(f"{'checkpoint':<20}{'step ' + str(result['step']):>14}{'step ' + str(cmp['step']):>14}")
        for k, vb in cmp["metrics"].items():
            lines.append(f"{k:<20}{_cell(result.get(k))}{_cell(vb)}{_cell(cmp['delta'].get(k))}")
        d = cmp["auc_diff"]
        if "error" in d:
            lines.append(f"AUC difference: {d['error']}")
        else:
            lines.append(f"AUC difference B - A: {d['delta']:+.5f}, {d['level']:.0%} CI [{d['ci_low']:+.5f}, "
                         f"{d['ci_high']:+.5f}] ({d['method']}, p = {d['p_value']:.3g})")
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return f"{'-':>14}"
    if isinstance(v, int):
        return f"{v:>14,}"
    return f"{v:>14.5f}"
