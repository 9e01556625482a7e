"""``recsys bench convert``: ``recsys convert --preset criteo`` vs pyarrow's own CSV → Parquet.

Both sides turn the same Criteo-layout TSV file (the synthetic data written by
``write_criteo_tsv``, decompressed once so that gzip's single-threaded inflate does not
dominate both sides) into zstd Parquet with row groups of 131,072 rows:

- ``read_csv + write_table``: ``pyarrow.csv.read_csv`` of the whole file (column types
  inferred, all Arrow threads) then ``pyarrow.parquet.write_table``: the shortest pyarrow
  program, holding the whole file in memory;
- ``open_csv + ParquetWriter``: pyarrow's streaming reader, each batch written as it comes
  (bounded memory, like ours);
- ours: ``recsys.io.convert.convert`` with the ``criteo`` preset (types fixed, values checked,
  bad rows located, progress, written on a second thread).

Runs alternate (ours, then each baseline) for ``repeats`` rounds; each comparison reports
the median rows/s of both sides and the median and spread (min, max) of the per-round
ratios, so a noisy neighbour slows both sides of a round alike. ``--quick``: 200k rows (full: 1M).
"""

from __future__ import annotations

import gzip
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from recsys.bench import comparison, paired_ratio

ROOT = Path(__file__).resolve().parents[2]
ROW_GROUP = 131_072


def ensure_file(quick: bool, data: Path | None) -> Path:
    """Return a Criteo-layout TSV file (uncompressed), generating it when missing."""
    from recsys.io import synth

    if data is not None:
        data = Path(data)
        if not data.is_file():
            raise FileNotFoundError(f"{data}: expected a Criteo-layout TSV file")
        return data
    rows = 200_000 if quick else 1_000_000
    target = ROOT / "bench-out" / "data" / f"criteo-tsv-{rows}"
    tsv = target / "train.txt"
    if not tsv.exists():
        print(f"generating {tsv} ...", flush=True)
        preset = synth.Preset(name=f"bench-convert-{rows}", train_rows=rows, eval_rows=1_000,
                              rows_per_file=rows, row_group_size=65_536)
        synth.write_criteo_tsv(target, preset)
        with gzip.open(target / "train.txt.gz", "rb") as src, open(f"{tsv}.tmp", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        Path(f"{tsv}.tmp").replace(tsv)
    return tsv


def _read_write_all(path: Path, out: Path) -> int:
    from recsys.io.convert import CRITEO_COLUMNS

    table = pa_csv.read_csv(path, read_options=pa_csv.ReadOptions(column_names=CRITEO_COLUMNS),
                            parse_options=pa_csv.ParseOptions(delimiter="\t"))
    pq.write_table(table, out / "all.parquet", compression="zstd", row_group_size=ROW_GROUP)
    return table.num_rows


def _stream(path: Path, out: Path) -> int:
    from recsys.io.convert import CRITEO_COLUMNS

    reader = pa_csv.open_csv(path, read_options=pa_csv.ReadOptions(column_names=CRITEO_COLUMNS),
                             parse_options=pa_csv.ParseOptions(delimiter="\t"))
    rows = 0
    with pq.ParquetWriter(out / "stream.parquet", reader.schema, compression="zstd") as writer:
        for batch in reader:
            writer.write_table(pa.Table.from_batches([batch]), row_group_size=ROW_GROUP)
            rows += batch.num_rows
    return rows


def _ours(path: Path, out: Path) -> int:
    from recsys.io.convert import ConvertOptions, convert

    report = convert([str(path)], out / "ours", ConvertOptions(fmt="tsv", preset="criteo", row_group_rows=ROW_GROUP))
    return report["rows"]


def measure(quick: bool, data: Path | None = None) -> dict:
    """Return rows/s of our conversion and of pyarrow's, side by side on one file."""
    path = ensure_file(quick, data)
    repeats = 3 if quick else 5
    sides = {"ours": _ours, "read_csv + write_table": _read_write_all, "open_csv + ParquetWriter": _stream}
    times: dict[str, list[float]] = {k: [] for k in sides}
    rows: dict[str, int] = {}
    (ROOT / "bench-out").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="recsys-bench-convert-", dir=ROOT / "bench-out") as tmp:
        for r in range(repeats):
            for name, fn in sides.items():
                out = Path(tmp) / f"{r}-{name.split()[0]}"
                out.mkdir()
                t0 = time.perf_counter()
                rows[name] = fn(path, out)
                times[name].append(time.perf_counter() - t0)
                shutil.rmtree(out)
    if len(set(rows.values())) != 1:
        raise RuntimeError(f"row counts differ between sides: {rows}")
    n = rows["ours"]
    comps = []
    for name in sides:
        if name == "ours":
            continue
        comps.append(comparison(f"convert vs {name}", n / statistics.median(times["ours"]),
                                n / statistics.median(times[name]), "rows/s", target_ratio=0.8,
                                **paired_ratio(times["ours"], times[name])))
    return {
        "comparisons": comps,
        "settings": {"file": str(path), "rows": n, "bytes": path.stat().st_size, "repeats": repeats,
                     "row_group_rows": ROW_GROUP, "compression": "zstd"},
        "seconds": times,
    }
