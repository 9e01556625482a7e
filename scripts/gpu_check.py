"""``make gpu-check``: every check of the CUDA path on a GPU machine, then one summary.

Runs with the machine's own Python and torch (no venv: a GPU image brings its CUDA torch),
the project's source on ``PYTHONPATH``, and the few wheels the image lacks installed from
``.whl/`` when it is there (``make gpu-wheels`` fills it on a machine that reaches a package
registry; the GPU machine needs no network). Steps, each with its log in ``OUT/``:

1. the ``cuda``-marked tests (``tests/`` files that have them);
2. ``recsys gen-synthetic --preset small``, then one epoch of ``jobs/synthetic_small.toml``
   with ``--device cuda`` (periodic validation and the final evaluation included);
3. ``recsys eval --device cuda`` of that run's checkpoint, and ``--device cpu`` of the same
   checkpoint (a GPU checkpoint read on the CPU);
4. ``recsys bench train --device cuda --quick``.

The summary (``OUT/summary.json``, printed last) names the GPU, each step's exit code and
time, the run's samples/s and AUCs. Exit code: 0 when every step passed.

Usage: ``python3 scripts/gpu_check.py [--out DIR] [--skip-bench]``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _environment(out: Path) -> dict[str, str]:
    """Return the environment of every step: the source (and ``.whl``'s packages) importable."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT)]
    wheels = sorted(glob.glob(str(ROOT / ".whl" / "*.whl")))
    if wheels:
        site = out / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *wheels], check=True)
        paths.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def _step(name: str, cmd: list[str], out: Path, env: dict, timeout: float, results: list) -> int:
    t0 = time.monotonic()
    log = out / f"{name}.log"
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    seconds = round(time.monotonic() - t0, 1)
    tail = log.read_text(errors="replace").splitlines()[-6:]
    print("\n".join("   " + line for line in tail), flush=True)
    results.append({"step": name, "rc": rc, "seconds": seconds, "log": str(log)})
    return rc


def _train_figures(run_dir: Path) -> dict:
    """Return the run's median samples/s over its logged windows and its evaluations."""
    out: dict = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return out
    rates, evals = [], []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "throughput/samples_per_s" in rec:
            rates.append(rec["throughput/samples_per_s"])
        if rec.get("event") == "eval":
            evals.append({k: rec[k] for k in ("step", "split", "auc") if k in rec})
    if rates:
        rates = sorted(rates[1:] or rates)  # the first window holds the start-up
        out["samples_per_s_median"] = round(rates[len(rates) // 2])
        out["samples_per_s_range"] = [round(rates[0]), round(rates[-1])]
    out["evaluations"] = evals
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu-check-out"))
    parser.add_argument("--skip-bench", action="store_true", help="leave out the quick GPU training bench")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = _environment(out)
    probe = subprocess.run([sys.executable, "-c", "import torch, json; print(json.dumps({'torch': torch.__version__, "
                            "'cuda': torch.version.cuda, 'gpus': torch.cuda.device_count(), 'gpu': "
                            "torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))"],
                           env=env, capture_output=True, text=True)
    machine = json.loads(probe.stdout) if probe.returncode == 0 else {"error": probe.stderr[-500:]}
    print("machine:", machine, flush=True)
    if not machine.get("gpus"):
        print("gpu-check: no CUDA GPU visible to this Python: nothing to check", file=sys.stderr)
        return 2
    py = [sys.executable]
    cli = py + ["-m", "recsys.cli"]
    results: list[dict] = []
    cuda_tests = sorted(p for p in glob.glob(str(ROOT / "tests" / "test_*.py"))
                        if "pytest.mark.cuda" in Path(p).read_text())
    # the machine's library versions differ from the pins: their deprecation notices are not ours to fail on
    lenient = ["-W", "ignore::DeprecationWarning", "-W", "ignore::FutureWarning"]
    _step("cuda-tests", py + ["-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *lenient, *cuda_tests],
          out, env, 900, results)
    data, run_dir = out / "data", out / "run"
    _step("data", cli + ["gen-synthetic", "--preset", "small", "--out", str(data)], out, env, 600, results)
    sets = [f"data.train.paths=['{data / 'train'}']", f"data.eval.paths=['{data / 'eval'}']",
            "train.epochs=1", "train.progress='none'", "train.eval_every=200"]
    _step("train", cli + ["train", "--config", "jobs/synthetic_small.toml", "--device", "cuda", "--run-dir",
                          str(run_dir), *[a for s in sets for a in ("--set", s)]], out, env, 900, results)
    for device in ("cuda", "cpu"):
        _step(f"eval-{device}", cli + ["eval", "--checkpoint", str(run_dir), "--device", device,
                                       "--oracle", str(data / "oracle.json"), "--json", str(out / f"eval-{device}.json")],
              out, env, 600, results)
    if not args.skip_bench:
        _step("bench-train-cuda", cli + ["bench", "train", "--device", "cuda", "--quick", "--json",
                                         str(out / "bench-train-cuda.json")], out, env, 900, results)
    summary = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "steps": results,
               "train": _train_figures(run_dir)}
    for device in ("cuda", "cpu"):
        path = out / f"eval-{device}.json"
        if path.exists():
            summary[f"eval_{device}"] = {k: v for k, v in json.loads(path.read_text()).items()
                                         if k in ("auc", "log_loss", "ne", "oracle_auc", "rows")}
    bench = out / "bench-train-cuda.json"
    if bench.exists():
        summary["bench_train_cuda"] = json.loads(bench.read_text()).get("summary")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    failed = [r["step"] for r in results if r["rc"] != 0]
    print("gpu-check:", "passed" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
