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

With ``schema.weight`` in the checkpoint's job every figure is weighted by the rows' sample
weights (``metrics.summarize``), slices and the streaming fallback too; weights all 1 give the
unweighted figures exactly. ``--compare`` weights B's rows by the same weights, and its CI of
the AUC difference is then a paired bootstrap (``metrics.bootstrap_auc_diff``): DeLong's
variance does not hold for weighted AUCs.

Every prediction is kept in memory up to ``max_exact_rows`` rows (``metrics.MAX_EXACT_ROWS``
by default) so the AUC is exact. A single process evaluating more rows than that switches to
``metrics.StreamingMetrics`` (binned AUC with its error bound stated in the result);
slices, plots, comparison and several processes need every row and fail with a clear error.

Slice columns: any column of the data, of any type, nulls being a value of their own. With
one process they are read next to the reader, in file order. With several processes each
rank scores its own share of row groups, so the parent reads the slice columns with the
job's passthrough id column(s) (``row_id``) from the files and joins them to the scored
rows on the id (``RowIndex``: vectorized, the id must be unique). Without an id column the
ranks carry integer, boolean or float slice columns without nulls through the reader; any
other is refused with what to do.
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
    weights: np.ndarray | None = None  # the rows' sample weights (schema.weight), None without


# --------------------------------------------------------------------------- columns


def data_columns(paths: list[str], partition_filter: str = "") -> tuple[list, dict]:
    """Return (files in reader order, {column: arrow type}) of the data.

    ``partition_filter`` (the job's ``data.eval.filter``) selects the files as the reader does,
    so slice columns are read from the very files that were scored.
    """
    import pyarrow.parquet as pq

    from recsys.io.partitions import parse_filter, select
    from recsys.io.units import expand_paths

    files = select(expand_paths(paths), parse_filter(partition_filter), ", ".join(paths))
    if not files:
        raise UserError(f"no Parquet files under {paths}")
    types: dict = {}
    for sf in files:
        schema = pq.read_schema(sf.path, filesystem=sf.filesystem)
        for field in schema:
            types.setdefault(field.name, field.type)
    return files, types


def check_slices(slices: list[str], types: dict) -> None:
    """Raise UserError naming a slice column the data lacks."""
    for col in slices:
        if col not in types:
            shown = ", ".join(list(types)[:40])
            raise UserError(f"--slice {col}: no such column in the data (columns: {shown})")


def read_data(files, columns: list[str]):
    """Return (``columns`` of ``files`` as one pyarrow Table in file order, first row of each file).

    A file without one of the columns, or with a type that cannot be cast to the first file's,
    is a UserError naming the file and the column.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(columns))  # `--slice c9 c9` reads c9 once
    parts, starts, first = [], [0], {}
    for sf in files:
        try:
            table = pq.read_table(sf.path, columns=columns, filesystem=sf.filesystem)
        except (pa.ArrowException, KeyError) as exc:
            raise UserError(f"{sf.display}: cannot read column(s) {', '.join(columns)}: "
                            f"{' '.join(str(exc).split())}") from None
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise UserError(f"{sf.display}: no column {missing[0]} (expected in every file of the data)")
        cols = []
        for c in columns:
            col = table.column(c)
            want = first.setdefault(c, (col.type, sf.display))
            if col.type != want[0]:
                try:
                    col = col.cast(want[0])
                except pa.ArrowException:
                    raise UserError(f"{sf.display}: column {c} is {col.type} but {want[0]} in {want[1]}; "
                                    "cannot put them in one column") from None
            cols.append(col)
        parts.append(pa.table(cols, names=columns))
        starts.append(starts[-1] + table.num_rows)
    return pa.concat_tables(parts), np.asarray(starts, dtype=np.int64)


def read_columns(files, columns: list[str], rows: int) -> dict:
    """Return ``columns`` of ``files`` concatenated in reader order (one process, no shuffle)."""
    table, _ = read_data(files, columns)
    if table.num_rows != rows:
        raise UserError(f"--slice {columns[0]}: the files hold {table.num_rows} rows but {rows} were scored "
                        "(a bad file skipped by on_bad_file?); cannot line the column up with the rows")
    return {c: table.column(c).combine_chunks() for c in columns}


class RowIndex:
    """Where each row of the data is, by its id columns: scored rows are joined back to the data.

    With several processes each rank scores its own share of row groups and carries only
    numeric columns, so the slice columns are read here from the files and joined to the
    scored rows on the passthrough id column(s) (``row_id``). Vectorized: each id column is
    factorized (``np.unique``), several are combined into one code (compressed after each
    step, so it never overflows int64), and scored ids are found by binary search. The ids
    must identify the rows (no repeats, no nulls): a UserError names two rows sharing one.
    """

    def __init__(self, table, starts: np.ndarray, files, id_cols: list[str], what: str) -> None:
        import pyarrow as pa

        self.table, self.id_cols, self.what = table, list(id_cols), what
        self.steps: list[tuple[np.ndarray, np.ndarray | None]] = []  # (uniques of the column, combined codes)
        code = None
        for c in self.id_cols:
            col = table.column(c)
            if col.null_count:
                row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                raise UserError(f"{what}: {_where(files, starts, row)}: the id column {c} is null; "
                                "the rows cannot be joined back to their slice values")
            if not (pa.types.is_integer(col.type) or pa.types.is_boolean(col.type)
                    or pa.types.is_floating(col.type)):
                raise UserError(f"{what}: the id column {c} is {col.type}; expected an integer, boolean or float "
                                "column (the reader carries only those)")
            values = _id_numpy(col.to_numpy(zero_copy_only=False))
            uniq, inv = np.unique(values, return_inverse=True)
            inv = inv.reshape(-1).astype(np.int64)
            if code is None:
                code, comb = inv, None
            else:
                comb, code = np.unique(code * len(uniq) + inv, return_inverse=True)
                code = code.reshape(-1).astype(np.int64)
            self.steps.append((uniq, comb))
        n = table.num_rows
        if code is not None and code.size and int(code.max()) + 1 != n:  # some rows share an id
            order = np.argsort(code, kind="stable")
            same = np.flatnonzero(code[order][1:] == code[order][:-1])
            i, j = int(order[same[0]]), int(order[same[0] + 1])
            key = ", ".join(f"{c}={table.column(c)[i].as_py()!r}" for c in self.id_cols)
            raise UserError(f"{what}: the id column(s) {', '.join(self.id_cols)} do not identify the rows: {key} "
                            f"is in {_where(files, starts, i)} and in {_where(files, starts, j)} "
                            f"({same.size:,} repeated in all); make the id unique or use --nproc 1")
        self.row_of = np.empty(n, dtype=np.int64)
        if code is not None:
            self.row_of[code] = np.arange(n, dtype=np.int64)

    def locate(self, ids: dict[str, np.ndarray]) -> np.ndarray:
        """Return the data row of each scored row, given the scored rows' id columns."""
        code = None
        for c, (uniq, comb) in zip(self.id_cols, self.steps):
            inv = _find(uniq, _id_numpy(np.asarray(ids[c])))
            if code is not None:
                inv = _find(comb, np.where((code < 0) | (inv < 0), -1, code * len(uniq) + inv))
            code = inv
        missing = np.flatnonzero(code < 0)
        if missing.size:
            key = ", ".join(f"{c}={_jsonable(ids[c][missing[0]])!r}" for c in self.id_cols)
            raise UserError(f"{self.what}: {missing.size:,} scored row(s) have ids the data files do not hold "
                            f"(first: {key}); were the files changed during the evaluation?")
        return self.row_of[code]

    def columns(self, names: list[str], ids: dict[str, np.ndarray]) -> dict:
        """Return ``names`` (pyarrow Arrays) lined up with the scored rows whose ids are ``ids``."""
        rows = self.locate(ids)
        return {c: self.table.column(c).take(rows).combine_chunks() for c in names}


def _id_numpy(values: np.ndarray) -> np.ndarray:
    """Ids as the reader carries them: int64, bool or float64."""
    if values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False)
    if values.dtype.kind == "f":
        return values.astype(np.float64, copy=False)
    return values


def _find(sorted_values: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Return the index of each value in ``sorted_values`` (unique, sorted), -1 when absent."""
    if sorted_values.size == 0:
        return np.full(values.shape, -1, dtype=np.int64)
    pos = np.minimum(np.searchsorted(sorted_values, values), sorted_values.size - 1)
    return np.where(sorted_values[pos] == values, pos, -1).astype(np.int64)


def _where(files, starts: np.ndarray, row: int) -> str:
    """Name a row of data read by ``read_data``: its file and row in that file."""
    f = int(np.searchsorted(starts, row, side="right")) - 1
    return f"{files[f].display} row {row - int(starts[f])}"


def _cannot_carry(col: str, nproc: int, reason: str, passthrough: list[str]) -> UserError:
    return UserError(f"--slice {col} with --nproc {nproc}: {reason}, and the data has no id column to join the "
                     f"slice values back to the scored rows on (the job's [data.eval] passthrough: {passthrough}); "
                     "use --nproc 1, or give the data a unique integer id column listed in passthrough "
                     "(e.g. row_id)")


def plan_slices(slices: list[str], files, types: dict, id_cols: list[str], passthrough: list[str], nproc: int):
    """Return (RowIndex or None, slice columns the processes carry) for ``--slice`` with several processes.

    With an id column every slice column is read here and joined on the id (any type; a null
    is a value, as with one process). Without one, the processes can carry only integer,
    boolean or float columns without nulls; any other slice column is a UserError saying why
    and what to do. Runs before any scoring, so a bad id fails fast.
    """
    import pyarrow as pa

    if not slices:
        return None, []
    if id_cols:
        table, starts = read_data(files, id_cols + [c for c in slices if c not in id_cols])
        return RowIndex(table, starts, files, id_cols, f"--slice with --nproc {nproc}"), []
    for col in slices:
        t = types[col]
        if not (pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t)):
            raise _cannot_carry(col, nproc, f"the column is {t} and the processes carry only integer, boolean or "
                                "float columns", passthrough)
    table, starts = read_data(files, list(slices))
    for col in slices:
        if table.column(col).null_count:
            row = int(np.flatnonzero(table.column(col).is_null().to_numpy(zero_copy_only=False))[0])
            raise _cannot_carry(col, nproc, f"the column has nulls (first in {_where(files, starts, row)}) and the "
                                "processes carry only columns without nulls", passthrough)
    return None, list(slices)


# --------------------------------------------------------------------------- scoring


def _collect(batches, max_rows: int, need_rows: str | None, calibration_bins: int):
    """Return (labels, scores, weights, extras) or, past ``max_rows`` rows, (None, StreamingMetrics, None, None)."""
    ys, ps, ws, ex = [], [], [], {}
    n, stream = 0, None
    for y, p, w, extra in batches:
        if stream is not None:
            stream.add(y, p, w)
            continue
        ys.append(y), ps.append(p), ws.append(w)
        for k, v in extra.items():
            ex.setdefault(k, []).append(v)
        n += y.size
        if n > max_rows:
            if need_rows:
                raise UserError(f"more than {max_rows:,} rows: {need_rows} needs every prediction in memory; "
                                "raise --max-exact-rows or evaluate fewer rows")
            stream = M.StreamingMetrics(exact_rows=max_rows)
            for a, b, c in zip(ys, ps, ws):
                stream.add(a, b, c)
            ys = ps = ws = ex = None
    if stream is not None:
        return None, stream, None, None
    cat = lambda xs: np.concatenate(xs) if xs else np.empty(0)  # noqa: E731
    weights = None if not ws or ws[0] is None else cat(ws)
    return cat(ys), cat(ps), weights, {k: cat(v) for k, v in ex.items()}


def _predictions_writer(out: Path | None):
    """Return (write(ids, labels, scores, weights), close(ok)) streaming rows to ``out`` (Parquet);
    a ``weight`` column follows ``score`` when the rows have sample weights.

    Rows go to a hidden temporary name beside ``out``; ``close(True)`` fsyncs it and renames it
    to ``out``, ``close(False)`` (Ctrl-C, a read error) removes it: ``out`` is every row or,
    as before the run, untouched."""
    if out is None:
        return (lambda *a: None), (lambda ok: None)
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsys.runtime.durable import fsync_dir, fsync_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    state = {"writer": None, "row": 0}

    def write(ids: dict, y: np.ndarray, p: np.ndarray, w: np.ndarray | None = None) -> None:
        cols = dict(ids) if ids else {"row_id": np.arange(state["row"], state["row"] + y.size, dtype=np.int64)}
        state["row"] += y.size
        weight = {} if w is None else {"weight": w.astype(np.float32)}
        table = pa.table({**cols, "label": y.astype(np.int8), "score": p.astype(np.float32), **weight})
        if state["writer"] is None:
            state["writer"] = pq.ParquetWriter(str(tmp), table.schema, compression="zstd")
        state["writer"].write_table(table)

    def close(ok: bool) -> None:
        try:
            if state["writer"] is not None:
                state["writer"].close()
            elif ok:  # no rows: still a valid, empty file
                pq.write_table(pa.table({"row_id": pa.array([], pa.int64()), "label": pa.array([], pa.int8()),
                                         "score": pa.array([], pa.float32())}), str(tmp))
            if ok:
                fsync_file(tmp)
                os.replace(tmp, out)
                fsync_dir(out.parent)
        finally:
            if not ok:
                tmp.unlink(missing_ok=True)

    return write, close


def score_one_process(checkpoint, paths, id_cols, passthrough, opts: EvalOptions, need_rows: str | None,
                      predictions: Path | None = None):
    """Score every row of ``paths`` in this process; return (Scored or None, StreamingMetrics or None)."""
    from recsys.eval.scoring import dense_stats_of, iter_predictions, load_trained

    job, store, model, path, meta = load_trained(checkpoint, opts.device)
    stats = dense_stats_of(job, meta, path)
    write, close = _predictions_writer(predictions)
    scored = False
    try:
        def batches():
            for y, p, w, extra in iter_predictions(job, store, model, paths, device=opts.device,
                                                   passthrough=passthrough, dense_stats=stats):
                write({k: extra[k] for k in id_cols}, y, p, w)
                yield y, p, w, extra
        y, p, w, extra = _collect(batches(), opts.max_exact_rows, need_rows, opts.calibration_bins)
        scored = True
    finally:
        try:
            close(scored)
        finally:
            store.close()
    if y is None:
        return None, p, str(path), meta["step"]
    return Scored(str(path), meta["step"], y, p, {k: extra[k] for k in id_cols},
                  {k: extra[k] for k in passthrough if k not in id_cols}, w), None, str(path), meta["step"]


# An evaluation of many rows may take hours; a rank that hangs fails its collectives after the
# process group's own timeout, so this is only the last resort.
RANKS_TIMEOUT_S = 24 * 3600


def _rank_scores(rank: int, world_size: int, checkpoint: str, paths: list[str], passthrough: list[str], device: str):
    """One rank of ``--nproc``: score this rank's share; rank 0 returns everyone's rows.

    Bad input (a UserError: the reader's ReadError...) is returned as ``("error", message,
    raised_here)`` rather than raised, so the parent shows the rank's one-line message, not
    the traceback of a peer that saw the connection close. ``iter_predictions`` stops every
    rank in the same step when one meets bad data, so no rank is left in a collective.
    """
    import torch.distributed as dist

    from recsys.eval.scoring import PeerStopped, dense_stats_of, iter_predictions, load_trained

    try:
        job, store, model, path, meta = load_trained(checkpoint, device)
        try:
            parts = list(iter_predictions(job, store, model, paths, device=device, passthrough=passthrough,
                                          rank=rank, world_size=world_size,
                                          dense_stats=dense_stats_of(job, meta, path)))
        finally:
            store.close()
    except UserError as exc:
        return "error", str(exc), not isinstance(exc, PeerStopped)
    cat = lambda xs: np.concatenate(xs) if xs else np.empty(0)  # noqa: E731
    weighted = bool(job.schema.weight)
    mine = (cat([a for a, _, _, _ in parts]), cat([b for _, b, _, _ in parts]),
            cat([w for _, _, w, _ in parts]) if weighted else None,
            {k: cat([e[k] for _, _, _, e in parts]) for k in passthrough})
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return "ok", None
    y = np.concatenate([g[0] for g in gathered])
    p = np.concatenate([g[1] for g in gathered])
    w = np.concatenate([g[2] for g in gathered]) if weighted else None
    extra = {k: np.concatenate([g[3][k] for g in gathered]) for k in passthrough}
    return "ok", (str(path), meta["step"], y, p, w, extra)


def score_processes(checkpoint, paths, id_cols, passthrough, opts: EvalOptions) -> Scored:
    """Score ``paths`` with ``opts.nproc`` gloo processes, each reading its exactly-once share."""
    from recsys.runtime.spawn import run_gloo

    results = run_gloo(_rank_scores, opts.nproc, str(checkpoint), list(paths), list(passthrough), opts.device,
                       error=UserError, timeout=RANKS_TIMEOUT_S)
    errors = sorted((not r[2], rank, r[1]) for rank, r in enumerate(results) if r[0] == "error")
    if errors:  # the rank that met the bad input first, else any
        raise UserError(f"--nproc {opts.nproc}: rank {errors[0][1]}: {errors[0][2]}")
    path, step, y, p, w, extra = results[0][1]
    if y.size > opts.max_exact_rows:
        raise UserError(f"more than {opts.max_exact_rows:,} rows: --nproc needs every prediction in memory; "
                        "raise --max-exact-rows or use --nproc 1 (binned AUC)")
    return Scored(path, step, y, p, {k: extra[k] for k in id_cols},
                  {k: extra[k] for k in passthrough if k not in id_cols}, w)


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


def slice_metrics(y: np.ndarray, p: np.ndarray, values, top_k: int, calibration_bins: int,
                  weights: np.ndarray | None = None) -> list[dict]:
    """Return the metrics of each slice group (see ``slice_groups``; groups by rows, metrics
    weighted by ``weights`` when given), calibration tables left out."""
    groups, idx = slice_groups(values, top_k)
    out = []
    for g, name in enumerate(groups):
        rows = idx == g
        m = M.summarize(y[rows], p[rows], calibration_bins, None if weights is None else weights[rows])
        m.pop("calibration_table", None)
        out.append({"value": name, **m})
    return out


# --------------------------------------------------------------------------- the command


def run_eval(checkpoint, opts: EvalOptions) -> dict:
    """Return the result of ``recsys eval`` (and write its files); see the module doc."""
    if opts.max_exact_rows is None:
        opts = dataclasses.replace(opts, max_exact_rows=M.MAX_EXACT_ROWS)
    from recsys.checkpoint import read as checkpoint_files
    from recsys.config import ConfigError

    path = checkpoint_files.resolve(checkpoint)
    job = _job_of(path)
    paths = opts.data or job.data.eval.paths
    if not paths:
        raise ConfigError(f"{path}: the job has no eval paths; pass --data")
    if opts.nproc < 1:
        raise UserError(f"--nproc must be at least 1, found {opts.nproc}")
    files, types = data_columns(paths, job.data.eval.filter)
    check_slices(opts.slices, types)
    id_cols = [c for c in job.data.eval.passthrough if c in types]
    need = [flag for flag, on in (("--slice", opts.slices), ("--plots", opts.plots), ("--compare", opts.compare))
            if on]
    need_rows = "/".join(need) or None
    if opts.nproc == 1:
        scored, stream, ck, step = score_one_process(path, paths, id_cols, id_cols, opts, need_rows, opts.predictions)
        if scored is not None and opts.slices:
            scored.slices = read_columns(files, opts.slices, scored.labels.size)
    else:
        index, carried = plan_slices(opts.slices, files, types, id_cols, list(job.data.eval.passthrough),
                                     opts.nproc)
        scored = score_processes(path, paths, id_cols, id_cols + carried, opts)
        if index is not None:
            scored.slices = index.columns(opts.slices, scored.ids)
        stream, ck, step = None, scored.checkpoint, scored.step
        if opts.predictions is not None:
            write, close = _predictions_writer(opts.predictions)
            written = False
            try:
                write(scored.ids, scored.labels, scored.scores, scored.weights)
                written = True
            finally:
                close(written)
    result = {"checkpoint": ck, "step": step, "data": list(paths)}
    if job.schema.weight:
        result["weight_column"] = job.schema.weight  # every figure below is weighted by it
    if scored is None:
        result.update(stream.result(opts.calibration_bins))
        return result
    result.update(M.summarize(scored.labels, scored.scores, opts.calibration_bins, scored.weights))
    result["nproc"] = opts.nproc
    if opts.slices:
        result["slices"] = {c: slice_metrics(scored.labels, scored.scores, scored.slices[c], opts.top_k,
                                             opts.calibration_bins, scored.weights) for c in opts.slices}
    if opts.predictions is not None:
        result["predictions"] = str(opts.predictions)
    if opts.compare is not None:
        result["compare"], scored_b = compare(scored, opts, paths, types)
    if opts.plots is not None:
        from recsys.eval.plots import write_plots

        other = scored_b if opts.compare is not None else None
        result["plots"] = [str(p) for p in write_plots(opts.plots, scored, result, other)]
    return result


def compare(a: Scored, opts: EvalOptions, paths, types) -> tuple[dict, Scored]:
    """Score the same rows with ``opts.compare``; return (its metrics, the deltas and the CI of the
    AUC difference; its rows).

    Both checkpoints' rows are weighted by A's sample weights (``a.weights``; B's own
    ``schema.weight``, if any, is not used) so the figures are of one weighted set. The CI is
    DeLong's without weights (or with weights all 1); with other weights it is a paired
    bootstrap (``metrics.bootstrap_auc_diff``), since DeLong's variance does not hold for
    weighted AUCs.
    """
    from recsys.checkpoint import read as checkpoint_files

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
    mb = M.summarize(b.labels, b.scores, opts.calibration_bins, a.weights)
    ma = M.summarize(a.labels, a.scores, opts.calibration_bins, a.weights)
    keys = ("auc", "log_loss", "normalized_entropy", "calibration", "ece", "ctr", "predicted_ctr", "rows", "positives")
    out = {"checkpoint": b.checkpoint, "step": b.step,
           "metrics": {k: mb[k] for k in keys if k in mb},
           "delta": {k: mb[k] - ma[k] for k in keys if k in ma and k in mb}}
    try:
        if a.weights is None or np.all(a.weights == 1.0):
            out["auc_diff"] = M.delong_auc_diff(a.labels, a.scores, b.scores)
        else:
            out["auc_diff"] = M.bootstrap_auc_diff(a.labels, a.scores, b.scores, a.weights)
    except ValueError as exc:
        out["auc_diff"] = {"error": str(exc)}
    return out, b


def _job_of(path: Path):
    from recsys.checkpoint import read as checkpoint_files
    from recsys import config as config_mod

    meta = checkpoint_files.load_meta(path)
    return config_mod.saved_job(meta["config"], f"{path}/meta.json:config")


# --------------------------------------------------------------------------- text tables


def format_tables(result: dict) -> str:
    """Return the human-readable tables of a result: slices and the comparison."""
    lines = []
    cols = ("rows", "positives", "ctr", "auc", "log_loss", "normalized_entropy", "calibration")
    if "weight_sum" in result:
        cols = cols[:2] + ("weight_sum",) + cols[2:]
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
                         f"{d['ci_high']:+.5f}] ({d['method']}, {_p_text(d['p_value'])})")
    return "\n".join(lines)


def _p_text(p: float) -> str:
    return "p < 1e-300" if p == 0 else f"p = {p:.3g}"


def _cell(v) -> str:
    if v is None:
        return f"{'-':>14}"
    if isinstance(v, int):
        return f"{v:>14,}"
    return f"{v:>14.5f}"
