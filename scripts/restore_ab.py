"""Compare the restore of spilled rows of this checkout with another checkout's, alternated.

    .venv/bin/python scripts/restore_ab.py OTHER_CHECKOUT [ROWS CAPACITY [ROUNDS]]

``OTHER_CHECKOUT``: a directory holding the ``recsys`` package (say, ``git worktree add
/tmp/base fd6d9da``). Each round runs both sides in turn (the order alternates), each in a
fresh process with a fresh redis-server: a one-table store (dim 16, row-wise Adagrad, the
given capacity, spilling to Redis) loads ROWS saved rows (default 2 M into 200 k), then
times two restores of them: into the same store, whose Redis holds the rows already
(``restore_running_s``), and into a new store of the same run directory, as a resumed run
builds it (``restore_fresh_s``, the start included: told a restore comes where the side
supports it, ``restoring=True``, else its start empties the namespace first). Prints each
round's seconds, the median µs per spilled row of each side and the paired ratios, and the CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

CHILD = r"""
import inspect, json, sys, tempfile, time
from pathlib import Path
import numpy as np
from recsys.testing.harness import start_redis
from recsys.features.schema import FeatureSpec, Schema, TableSpec
from recsys.store.config import StoreConfig
from recsys.store.sharded.store import ShardedEmbeddingStore
from recsys.store.tables.table import EmbeddingTable

n, cap = int(sys.argv[1]), int(sys.argv[2])
tmp = Path(tempfile.mkdtemp(prefix="restore-ab-"))
server = start_redis(tmp / "redis")
try:
    src = EmbeddingTable("t", TableSpec(dim=16, capacity=n), StoreConfig())
    keys = np.random.default_rng(0).integers(-(1 << 63), (1 << 63) - 1, size=n, dtype=np.int64)
    for step, start in enumerate(range(0, n, 100_000)):
        src.lookup(keys[start : start + 100_000], step)
    saved = {"t": src.state_dict()}
    del src
    schema = Schema(dense=["d"], tables={"t": TableSpec(dim=16, capacity=cap)}, sparse=[FeatureSpec(name="t")])
    cfg = StoreConfig(spill_url=server.url)

    def store(**kw):
        return ShardedEmbeddingStore(schema, cfg, run_dir=tmp / "run", job_name="ab", **kw)

    # a side that can be told a restore comes (the trainer tells it when it resumes)
    resume = {"restoring": True} if "restoring" in inspect.signature(ShardedEmbeddingStore).parameters else {}

    first = store()
    first.load_state_dict(saved)  # Redis now holds the rows beyond the capacity
    first.flush()
    t0 = time.perf_counter()
    first.load_state_dict(saved)
    first.flush()
    running = time.perf_counter() - t0
    first.close()
    t0 = time.perf_counter()
    again = store(**resume)
    again.load_state_dict(saved)
    again.flush()
    fresh = time.perf_counter() - t0
    assert again.state_dict()["t"].equals(saved["t"])
    again.close()
    print(json.dumps({"restore_running_s": running, "restore_fresh_s": fresh}))
finally:
    server.stop()
"""


def run_side(checkout: Path, n: int, cap: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "NUMBA_CACHE_DIR": tempfile.mkdtemp(prefix="restore-ab-numba-")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(cap)], env=env, cwd=checkout,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"restore_ab: the side at {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    other = Path(argv[0]).resolve()
    if not (other / "recsys" / "store" / "spill.py").is_file():
        print(f"restore_ab: no recsys package under {other}", file=sys.stderr)
        return 2
    n = int(argv[1]) if len(argv) > 1 else 2_000_000
    cap = int(argv[2]) if len(argv) > 2 else 200_000
    rounds = int(argv[3]) if len(argv) > 3 else 3
    sys.path.insert(0, str(HERE))
    from recsys.bench import cpu_info

    cpu = cpu_info()
    print(f"{cpu['model']}, {cpu['cores']} cores, SIMD {' '.join(cpu['simd'])}, numba target {cpu.get('numba_target', '?')}")
    print(f"{n} rows into capacity {cap}: {n - cap} spilled; {rounds} rounds, sides alternated; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    sides = {"this": HERE, "other": other}
    got: dict[str, list[dict]] = {"this": [], "other": []}
    for r in range(rounds):
        order = ["this", "other"] if r % 2 == 0 else ["other", "this"]
        for name in order:
            got[name].append(run_side(sides[name], n, cap))
        print(f"round {r + 1}: " + "; ".join(
            f"{name} running {got[name][-1]['restore_running_s']:.2f} s, fresh {got[name][-1]['restore_fresh_s']:.2f} s"
            for name in ("this", "other")), flush=True)
    spilled = n - cap
    for what in ("restore_running_s", "restore_fresh_s"):
        per_row = {name: statistics.median(g[what] for g in got[name]) / spilled * 1e6 for name in got}
        ratios = [o[what] / t[what] for t, o in zip(got["this"], got["other"])]
        print(f"{what[:-2]}: this {per_row['this']:.2f} µs, other {per_row['other']:.2f} µs a spilled row; "
              f"other / this median {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
