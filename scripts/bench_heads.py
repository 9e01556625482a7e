"""Samples/s of the dense training step at several ``model.heads``, side by side.

    python scripts/bench_heads.py [--job jobs/synthetic_small.toml] [--rounds 12] [--steps 20]
        --variant NAME=ROOT:HEADS ...

Each variant is one worker process importing ``recsys`` from its ROOT (another checkout: the
code before a change) and building the job's model (``model_for``) with ``model.heads =
HEADS`` (1: the key is not set, so a checkout without it runs too). A worker trains the
dense step alone, as ``recsys bench train``'s "limit" does: forward, backward (the loss the
trainer uses: the mean of the heads' losses) and the Adam step (foreach), on a few
pre-made in-memory batches of the job's batch size (random dense values and pooled
embeddings), 2 torch threads. No reading and no embedding work, so a ratio here is the
whole of what heads cost a step's dense part: a trainer's step, which adds the store's
work, slows by less.

Rounds are interleaved: every round runs ``--steps`` steps of each variant in turn (the
order rotated each round), the others waiting, so a noisy neighbour hurts all alike. The
first ``--warmup`` rounds are not counted. Printed: each variant's samples/s (median over
rounds) and its per-round ratio to the first variant (median, min and max), and the JSON
of every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(job_path: str, heads: int, batches: int) -> None:
    """Answer each line on stdin (a step count) with the seconds those steps took."""
    import torch

    from recsys.config import load_job
    from recsys.model.arch import model_for

    torch.set_num_threads(2)
    job = load_job(job_path, [f"model.heads={heads}"] if heads != 1 else [])
    schema = job.schema
    N, F = len(schema.dense), len(schema.sparse)
    (D,) = {t.dim for t in schema.tables.values()}
    B = job.data.train.batch_size
    torch.manual_seed(job.train.seed)
    model = model_for(job)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=job.train.optim.lr, foreach=True)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(B, N, generator=g), (torch.rand(B, F, D, generator=g) * 2 - 1) * 0.1,
             (torch.rand(B, generator=g) < 0.17).float()) for _ in range(batches)]
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"batch": B, "params": params}), flush=True)
    step = 0
    for line in sys.stdin:
        n = int(line)
        t0 = time.perf_counter()
        for _ in range(n):
            dense, pooled, labels = data[step % batches]
            logits = model(dense, pooled)
            target = labels if logits.dim() == 1 else labels.unsqueeze(1).expand_as(logits)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            loss.item()
            step += 1
        print(time.perf_counter() - t0, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(HERE.parents[1] / "jobs" / "synthetic_small.toml"))
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ROOT:HEADS")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--heads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.job, args.heads, args.batches)
        return
    variants = []
    for spec in args.variant:
        name, rest = spec.split("=", 1)
        root, heads = rest.rsplit(":", 1)
        env = {**os.environ, "PYTHONPATH": str(Path(root).resolve())}
        proc = subprocess.Popen([sys.executable, str(HERE), "--worker", "--job", args.job, "--heads", heads,
                                 "--batches", str(args.batches)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env, cwd=Path(root).resolve())
        info = json.loads(proc.stdout.readline())
        variants.append({"name": name, "root": root, "heads": int(heads), "proc": proc, **info, "s": []})
    for r in range(args.rounds + args.warmup):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            v["proc"].stdin.write(f"{args.steps}\n")
            v["proc"].stdin.flush()
            seconds = float(v["proc"].stdout.readline())
            if r >= args.warmup:
                v["s"].append(seconds)
    for v in variants:
        v["proc"].stdin.close()
        v["proc"].wait()
    ref = variants[0]
    rows = []
    for v in variants:
        rate = [v["batch"] * args.steps / s for s in v["s"]]
        ratio = [a / b for a, b in zip(ref["s"], v["s"])]  # this variant's samples/s over the first's
        rows.append({"name": v["name"], "heads": v["heads"], "params": v["params"],
                     "samples_per_s": statistics.median(rate), "ratio_median": statistics.median(ratio),
                     "ratio_min": min(ratio), "ratio_max": max(ratio), "seconds": v["s"]})
    print(f"{'variant':<12} {'heads':>5} {'params':>9} {'samples/s':>10}   vs {ref['name']}: median [min, max]")
    for row in rows:
        print(f"{row['name']:<12} {row['heads']:>5} {row['params']:>9} {row['samples_per_s']:>10.0f}   "
              f"{row['ratio_median']:.3f} [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]")
    print(json.dumps({"job": args.job, "steps": args.steps, "rounds": args.rounds, "rows": rows}))


if __name__ == "__main__":
    main()
