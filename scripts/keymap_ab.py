"""Compare this checkout's key map with another checkout's, interleaved in one process.

    .venv/bin/python scripts/keymap_ab.py OTHER_CHECKOUT [CAPACITY ...]

``OTHER_CHECKOUT``: a directory holding ``recsys/store/tables/keymap.py`` (say, ``git worktree add
/tmp/base daff01e``). Per capacity, both maps hold the same random keys; each of 12 rounds
times, for each map in turn (the order alternates): lookups of held keys (Zipf(1.05) over
them, 10 calls of 16 Ki keys), ``find`` of the same keys, and lookups of 10 × 4 Ki new keys,
which evict as many. Prints the median ns a key of each, and the CPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

# A numba cache of its own, new each run: kernels of a module loaded from a path, cached by an
# earlier run, fail to load from the cache ("No module named '<dynamic>'").
os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="keymap-ab-numba-")

import numpy as np  # noqa: E402 (after NUMBA_CACHE_DIR)

HERE = Path(__file__).resolve().parent.parent
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    other = Path(argv[0]) / "recsys" / "store" / "keymap.py"
    if not other.is_file():
        print(f"keymap_ab: no {other}", file=sys.stderr)
        return 2
    capacities = [int(a) for a in argv[1:]] or [1_000_000, 8_000_000]
    mods = {"other": _load("keymap_other", other), "this": _load("keymap_this", HERE / "recsys/store/tables/keymap.py")}
    from recsys.bench import cpu_info

    cpu = cpu_info()
    print(f"{cpu['model']}, {cpu['cores']} cores, SIMD {' '.join(cpu['simd'])}, numba target {cpu.get('numba_target', '?')}")
    rng = np.random.default_rng(0)

    def zipf_index(n: int, m: int) -> np.ndarray:
        r = rng.zipf(1.05, size=n * 3)
        return r[r <= m][:n] - 1

    for cap in capacities:
        held = rng.integers(I64_MIN, I64_MAX, size=cap, dtype=np.int64)
        perm = rng.permutation(cap)
        maps = {}
        for label, mod in mods.items():
            km = mod.KeyMap(cap)
            km.lookup(held, 0)
            km.find(held[:100])
            km.lookup(rng.integers(I64_MIN, I64_MAX, size=5000, dtype=np.int64), 1)  # compiles the eviction path
            maps[label] = km
        times = {label: {"hits": [], "find": [], "evict": []} for label in mods}
        for r in range(12):
            hits = [held[perm[zipf_index(16384, cap)]] for _ in range(10)]
            new = [rng.integers(I64_MIN, I64_MAX, size=4096, dtype=np.int64) for _ in range(10)]
            step = 2 + r
            for label in (list(mods) if r % 2 else list(mods)[::-1]):
                km = maps[label]
                t = time.perf_counter()
                for b in hits:
                    km.lookup(b, step)
                times[label]["hits"].append((time.perf_counter() - t) / (10 * 16384))
                t = time.perf_counter()
                for b in hits:
                    km.find(b)
                times[label]["find"].append((time.perf_counter() - t) / (10 * 16384))
                t = time.perf_counter()
                for b in new:
                    km.lookup(b, step)
                times[label]["evict"].append((time.perf_counter() - t) / (10 * 4096))
        for label, parts in times.items():
            cells = "  ".join(f"{part} {np.median(v) * 1e9:6.1f}" for part, v in parts.items())
            print(f"capacity {cap:>11,}  {label:5}  ns a key (median of 12): {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
