"""The dense step alone (bench train's limit (c): the synthetic job's DLRM on in-memory batches)
with the interaction's own backward against autograd's (``bmm(x, xᵀ)`` then an
``index_select``, as until 2026-11-29), alternated in one process.

    .venv/bin/python scripts/interaction_ab.py [BATCH] [THREADS] [ROUNDS]

Prints each side's median ms a step and the paired median of old / new.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from recsys.bench.train import JOB, Limit  # noqa: E402
from recsys.config import load_job  # noqa: E402
from recsys.model.arch import DotInteraction  # noqa: E402


class AutogradInteraction(DotInteraction):
    """The same forward, differentiated by autograd."""

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        inter = torch.bmm(combined, combined.transpose(1, 2))
        return torch.cat((dense_features, inter.flatten(1).index_select(1, self.flat_triu)), dim=1)


def main(batch: int = 2048, threads: int = 1, rounds: int = 12, steps: int = 10) -> None:
    torch.set_num_threads(threads)
    job = load_job(Path(JOB))
    sides = {}
    for name in ("new", "old"):
        limit = Limit(job, batch, 4)
        if name == "old":
            limit.model.interaction.__class__ = AutogradInteraction
        limit.run(steps, False)  # warm-up
        sides[name] = limit
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
            t0 = time.perf_counter()
            sides[name].run(steps, False)
            ms[name].append((time.perf_counter() - t0) / steps * 1e3)
    paired = [o / n for o, n in zip(ms["old"], ms["new"])]
    print(f"batch {batch}, {threads} thread(s), {rounds} rounds of {steps} steps: "
          + ", ".join(f"{k} {statistics.median(v):.2f} ms" for k, v in ms.items())
          + f"; old/new paired median {statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
