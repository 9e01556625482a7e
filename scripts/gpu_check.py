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
4. ``recsys bench train --device cuda --quick`` (``--bench full``: the full bench on the
   data of step 2, the issue's figures; ``--bench none``: no bench).

The data of step 2 is generated while the tests of step 1 run. ``--budget S`` bounds the
whole check: a step that would outrun it is stopped (exit code 124 in the summary), so the
summary is always written. A failed step's log tail is printed in full.

The summary (``OUT/summary.json``, printed last) names the GPU, each step's exit code and
time, the run's samples/s and AUCs. Exit code: 0 when every step passed.

Usage: ``python3 scripts/gpu_check.py [--out DIR] [--bench quick|full|none] [--budget S]``.
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


class _Steps:
    """Runs the steps, each with its log in ``out``, none past the check's deadline."""

    def __init__(self, out: Path, env: dict, budget_s: float):
        self.out, self.env, self.deadline = out, env, time.monotonic() + budget_s
        self.results: list[dict] = []

    def start(self, name: str, cmd: list[str]):
        """Start a step in the background; ``finish`` waits for it."""
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        fh = open(self.out / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        return name, proc, fh, time.monotonic()

    def finish(self, started, timeout: float) -> int:
        name, proc, fh, t0 = started
        try:
            rc = proc.wait(timeout=max(1.0, min(timeout - (time.monotonic() - t0), self.deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
        fh.close()
        log = self.out / f"{name}.log"
        lines = log.read_text(errors="replace").splitlines()
        print("\n".join("   " + line for line in lines[-(60 if rc else 6):]), flush=True)
        self.results.append({"step": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "log": str(log)})
        return rc

    def run(self, name: str, cmd: list[str], timeout: float) -> int:
        return self.finish(self.start(name, cmd), timeout)


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
    parser.add_argument("--bench", choices=("quick", "full", "none"), default="quick",
                        help="the GPU training bench: --quick (default), the full one on step 2's data, or none")
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds the whole check may take")
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
    steps = _Steps(out, env, args.budget)
    cuda_tests = sorted(p for p in glob.glob(str(ROOT / "tests" / "test_*.py"))
                        if "pytest.mark.cuda" in Path(p).read_text())
    # the machine's library versions differ from the pins: their deprecation notices are not ours to fail on
    lenient = ["-W", "ignore::DeprecationWarning", "-W", "ignore::FutureWarning"]
    data, run_dir = out / "data", out / "run"
    generating = steps.start("data", cli + ["gen-synthetic", "--preset", "small", "--out", str(data)])
    steps.run("cuda-tests", py + ["-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *lenient,
                                  *cuda_tests], 240)
    steps.finish(generating, 600)
    sets = [f"data.train.paths=['{data / 'train'}']", f"data.eval.paths=['{data / 'eval'}']",
            "train.epochs=1", "train.progress='none'", "train.eval.every=200"]
    steps.run("train", cli + ["train", "--config", "jobs/synthetic_small.toml", "--device", "cuda", "--run-dir",
                              str(run_dir), *[a for s in sets for a in ("--set", s)]], 240)
    for device in ("cuda", "cpu"):
        steps.run(f"eval-{device}", cli + ["eval", "--checkpoint", str(run_dir), "--device", device, "--oracle",
                                           str(data / "oracle.json"), "--json", str(out / f"eval-{device}.json")], 120)
    if args.bench != "none":
        which = ["--quick"] if args.bench == "quick" else ["--data", str(data)]
        steps.run("bench-train-cuda", cli + ["bench", "train", "--device", "cuda", *which, "--json",
                                             str(out / "bench-train-cuda.json")], 900)
    results = steps.results
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
