"""Alternate ``recsys train`` configurations on the small synthetic set; print each round's
samples/s and phases, then every side's paired ratio against the first side.

    .venv/bin/python scripts/train_ab.py ROUNDS LABEL=NPROC[:KEY=VALUE;KEY=VALUE] ...

e.g. ``scripts/train_ab.py 5 gloo=2:train.local_exchange=false shm=2 one=1``: 400 steps a run
(``STEPS``), batch 4096 over the processes (1 thread each; one process: 2), the first 42
steps untimed, ``OMP_WAIT_POLICY=PASSIVE``; the order of the sides reverses every round.
Every side times the same steps; ratio = first side's seconds / this side's, per round: median (min-max) and of the totals.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHUNK, WARM = 21, 42


def run(label: str, world: int, sets: list[str], steps: int, out: Path) -> tuple[float, dict]:
    threads = 2 if world == 1 else 1
    run_dir = out / label
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--nproc", str(world), "--config",
           str(ROOT / "jobs" / "synthetic_small.toml"), "--run-dir", str(run_dir)]
    for o in ["data.eval.paths=[]", f"data.train.batch_size={4096 // world}", "train.epochs=1",
              f"train.max_steps={steps}", f"train.threads={threads}", f"train.log_every={CHUNK}",
              "train.progress='none'", *sets]:
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{label}: recsys train failed\n{p.stderr[-3000:]}")
    seconds, rows, phases, before = 0.0, 0, {}, 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "event" in rec:
            continue
        window, before = rec["step"] - before, rec["step"]  # a window's steps (the last may be short)
        if rec["step"] <= WARM:
            continue
        rows += window * 4096
        seconds += window * 4096 / rec["throughput/samples_per_s"]
        for k, v in rec.items():
            if k.startswith("time/") and k.endswith("_ms"):
                phases[k[5:-3]] = phases.get(k[5:-3], 0.0) + v * window
    return seconds, rows, {k: v * 4096 / rows for k, v in phases.items()}


def main() -> None:
    rounds = int(sys.argv[1])
    sides = []
    for arg in sys.argv[2:]:
        label, spec = arg.split("=", 1)
        world, _, sets = spec.partition(":")
        sides.append((label, int(world), [s for s in sets.split(";") if s]))
    steps = int(os.environ.get("STEPS", 400))
    seconds: dict[str, list[float]] = {s[0]: [] for s in sides}
    with tempfile.TemporaryDirectory(prefix="train-ab-") as tmp:
        for r in range(rounds):
            for label, world, sets in (sides if r % 2 == 0 else sides[::-1]):
                secs, rows, phases = run(label, world, sets, steps, Path(tmp) / f"r{r}")
                seconds[label].append(secs)
                print(f"round {r} {label}: {rows / secs / 1e3:.1f} k samples/s, per step "
                      + " ".join(f"{k} {v:.1f} ms" for k, v in sorted(phases.items())), flush=True)
    base = sides[0][0]
    for label, *_ in sides[1:]:
        ratios = [b / s for b, s in zip(seconds[base], seconds[label])]
        print(f"{label} vs {base}: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}), totals {sum(seconds[base]) / sum(seconds[label]):.3f}")


if __name__ == "__main__":
    main()
