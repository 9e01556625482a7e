"""Benchmarks behind ``recsys bench TARGET``: side by side in one run, reported as ratios.

Every target module has ``measure(quick: bool, data: Path | None) -> dict`` returning at
least ``comparisons: [{"name", "ours", "baseline", "ratio", "unit"}]`` (ratio = ours /
baseline, higher is better for ours) plus whatever else is useful. ``run`` adds the
environment (date, versions, threads, peak RSS), prints the table and writes the JSON.
No assertions on timings here or anywhere.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import json
import logging
import os
import platform
import resource
import statistics
import sys
import warnings
from pathlib import Path


@contextlib.contextmanager
def quiet_fbgemm():
    """Silence fbgemm's import notices and its INFO log lines (one per loaded library)."""
    before = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def passive_omp() -> tuple[dict, bool]:
    """Make OpenMP threads sleep, not spin, when idle (unless the caller chose a policy).

    On 2 cores shared with other processes, libgomp's default spin-waiting turns every
    small parallel region of a 2-thread process into a wait for a descheduled spinner:
    measured here under load, a 2-thread store step took 0.8-5 s with spinning and
    0.10-0.24 s with ``OMP_WAIT_POLICY=PASSIVE``. It only takes effect if set before
    libgomp loads (torch's import); spawned ranks inherit it. Both sides of every
    comparison run under the same policy."""
    ours = "OMP_WAIT_POLICY" not in os.environ
    effective = "torch" not in sys.modules
    if ours:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    info = {
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "set_by_bench": ours,
        "effective_in_main_process": effective or not ours,
    }
    return info, ours


def with_passive_omp(run) -> dict:
    """Return ``run()``'s result dict, run under ``passive_omp``'s policy (the environment
    restored after), its ``settings`` naming the policy (``openmp``)."""
    omp, restore = passive_omp()
    try:
        result = run()
    finally:
        if restore:
            os.environ.pop("OMP_WAIT_POLICY", None)
    result["settings"]["openmp"] = omp
    return result


def versions() -> dict:
    """Return the versions of the libraries a figure depends on."""
    import numba
    import pyarrow
    import torch
    import torchrec

    with quiet_fbgemm():
        import fbgemm_gpu
    return {
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "?"),
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
        "numpy": __import__("numpy").__version__,
        "numba": numba.__version__,
        "pyarrow": pyarrow.__version__,
    }


def comparison(name: str, ours: float, baseline: float, unit: str, **extra) -> dict:
    """Return one comparison row; ``ratio`` is ours / baseline."""
    return {
        "name": name,
        "ours": ours,
        "baseline": baseline,
        "ratio": ours / baseline if baseline else float("nan"),
        "unit": unit,
        **extra,
    }


def paired_ratio(ours_s: list[float], baseline_s: list[float]) -> dict:
    """Return the per-round rate ratios (ours over the baseline; ``paired_ratios``), their
    ``median_paired_ratio`` and ``spread`` [min, max], from the seconds each side took in the
    same rounds: a noisy moment slows both sides of a round alike, so paired ratios spread
    less than either side's rate."""
    ratios = [b / a for a, b in zip(ours_s, baseline_s)]
    return {"median_paired_ratio": round(statistics.median(ratios), 4),
            "spread": [round(min(ratios), 4), round(max(ratios), 4)], "paired_rounds": len(ratios),
            "paired_ratios": [round(r, 4) for r in ratios]}


def peak_rss_mb() -> dict:
    """Return peak resident memory of this process and of its finished children, in MiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"self": round(own, 1), "children": round(kids, 1)}


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile",
              "asimd", "sve")


def cpu_info() -> dict:
    """Return the CPU model, core count, the SIMD flags that matter and numba's target CPU."""
    model, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key in ("model name", "hardware") and model in ("?", "", platform.machine()):
                model = value.strip()
            elif key in ("flags", "features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    info = {"model": model, "cores": os.cpu_count(), "simd": [f for f in SIMD_FLAGS if f in flags]}
    try:
        import llvmlite.binding as llvm

        info["numba_target"] = os.environ.get("NUMBA_CPU_NAME") or llvm.get_host_cpu_name()
        if os.environ.get("NUMBA_CPU_FEATURES"):
            info["numba_features"] = os.environ["NUMBA_CPU_FEATURES"]
    except Exception:  # noqa: BLE001 - informative only
        pass
    return info


def environment() -> dict:
    """Return versions and machine facts that make a figure reproducible."""
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cpu": cpu_info(),
        "command": " ".join(["recsys", *sys.argv[1:]]) if sys.argv else "",
    }
    for mod in ("numpy", "pyarrow", "numba", "torch", "torchrec"):
        if mod in sys.modules:
            env[mod] = getattr(sys.modules[mod], "__version__", "?")
    return env


def format_table(result: dict) -> str:
    """Return the comparisons as an aligned text table."""
    rows = [("comparison", "ours", "baseline", "ratio", "unit", "paired: median (min-max) / mean [95 %]")]
    for c in result["comparisons"]:
        pair = (f"{c['median_paired_ratio']:.3f} ({c['spread'][0]:.3f}-{c['spread'][1]:.3f})"
                if "median_paired_ratio" in c else "")
        if "interval_95" in c:
            pair = f"{c['difference']:+.4f} [{c['interval_95'][0]:+.4f}, {c['interval_95'][1]:+.4f}]"
        rows.append((c["name"], f"{c['ours']:.4g}", f"{c['baseline']:.4g}", f"{c['ratio']:.3f}", c["unit"], pair))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(target: str, json_out: Path | None = None, quick: bool = False, data: Path | None = None,
        **options) -> dict:
    """Run benchmark ``target``, print its table, write ``json_out``; return the result.
    ``options``: the target's own keyword arguments (``quality``: ``tuned``, ``splits``)."""
    module = importlib.import_module(f"recsys.bench.{target}")
    result = module.measure(quick=quick, data=data, **options)
    result = {"target": target, "quick": quick, **result}
    result["peak_rss_mb"] = peak_rss_mb()
    result["environment"] = environment()
    cpu = result["environment"]["cpu"]
    print(f"recsys bench {target}{' --quick' if quick else ''}  on {cpu['model']}, {cpu['cores']} cores, "
          f"SIMD {' '.join(cpu['simd']) or 'none'}, numba target {cpu.get('numba_target', '?')}")
    print(format_table(result))
    for note in result.get("notes", []):
        print(note)
    for sc in result.get("scenarios", []):
        print(f"{'PASS' if sc['passed'] else 'FAIL'}  {sc['name']}  {json.dumps(sc['figure'])}")
    print(f"peak RSS: {result['peak_rss_mb']['self']} MiB (children {result['peak_rss_mb']['children']} MiB)")
    if json_out is not None:
        json_out = Path(json_out)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_out}")
    return result
