"""What a run reports: ``metrics.jsonl``, TensorBoard events, and a progress display (rank 0).

Metric keys are grouped by prefix: ``loss/train``, ``throughput/samples_per_s``,
``time/<phase>_ms`` (mean per step over the window), ``time/<phase>_pct``,
``store/hit_rate``, ``store/evictions``, ``store/staleness``, ``store/rows``, ``lr``; every
line also has ``step`` and ``epoch``. Store counters are rank 0's shard's (each shard sees a
similar mix of keys). Event lines have ``event`` (``eval``, ``checkpoint``, ``resumed``,
``best``, ``epoch_end``) and the event's fields.

TensorBoard (``RUN_DIR/tensorboard``) gets every numeric field under the same tag; an
event's numeric fields under ``<event>/<field>`` (``eval/auc``...). The event file is
flushed at every checkpoint, so a run killed later still has every scalar up to its
last checkpoint there (``metrics.jsonl`` is written line by line).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from recsys.eval.metrics import evaluate_predictions

__all__ = ["MetricsLog", "Progress", "evaluate_predictions"]


class MetricsLog:
    """Appends one JSON line per ``log_every`` steps (and per event) to ``metrics.jsonl``."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.samples_per_s = 0.0
        self.last_loss = float("nan")  # loss/train of the last logged window
        self._window_start = time.perf_counter()
        self._reset()
        self._last_counters: dict[str, int] = {}
        self._fh = None
        self._tb = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._fh = open(run_dir / "metrics.jsonl", "a", buffering=1)
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def _reset(self) -> None:
        self._steps = 0
        self._loss = 0.0
        self._rows = 0
        self._phases: dict[str, float] = {}

    def step(self, step: int, epoch: int, loss, rows: int, world_size: int, phases: dict[str, float],
             store, lr: float, log_every: int) -> None:
        """Account one step (every rank calls it); every ``log_every`` steps write the window's means.

        ``loss``: the step's mean loss, a float or a float64 tensor on the device (summed
        there, so a GPU is waited for once per window, not every step).

        ``loss/train`` is the mean over every rank's rows of the window (one all-reduce per
        logged window), so it is comparable across world sizes.
        """
        self._steps += 1
        self._loss += loss * rows
        self._rows += rows
        for k, v in phases.items():
            self._phases[k] = self._phases.get(k, 0.0) + v
        if step % log_every:
            return
        loss_sum, total_rows = float(self._loss), self._rows  # a GPU's loss tensor: read once a window
        if world_size > 1:
            import torch
            import torch.distributed as dist

            t = torch.tensor([loss_sum, float(total_rows)], dtype=torch.float64)
            dist.all_reduce(t)
            loss_sum, total_rows = t.tolist()
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        self.samples_per_s = total_rows / elapsed
        self.last_loss = loss_sum / total_rows if total_rows else 0.0
        record = {
            "step": step,
            "epoch": epoch,
            "loss/train": loss_sum / total_rows if total_rows else 0.0,
            "throughput/samples_per_s": self.samples_per_s,
            "lr": lr,
            "store/staleness": store.staleness,
        }
        total = sum(self._phases.values()) or 1e-9
        for k, v in self._phases.items():
            record[f"time/{k}_ms"] = 1000 * v / self._steps
            record[f"time/{k}_pct"] = 100 * v / total
        counters = _sum_counters(store.counters())
        delta = {k: v - self._last_counters.get(k, 0) for k, v in counters.items()}
        self._last_counters = counters
        lookups = delta.get("hits", 0) + delta.get("misses", 0)
        record["store/hit_rate"] = delta.get("hits", 0) / lookups if lookups else 0.0
        record["store/evictions"] = delta.get("evictions", 0)
        record["store/rows"] = counters.get("rows", 0)
        publisher = getattr(store, "publisher", None)
        if publisher is not None:  # rank 0's live pushes (the ``publish`` event at the end sums the ranks)
            record.update(publisher.metrics())
        self._write(record)
        self._window_start = now
        self._reset()

    def event(self, name: str, **fields) -> None:
        """Write one event line (eval results, checkpoints, resumes)."""
        self._write({"event": name, **fields})
        if name == "checkpoint" and self._tb is not None:
            self._tb.flush()  # what a resume from this checkpoint would not write again

    def _write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._fh.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        prefix = f"{record['event']}/" if "event" in record else ""
        for k, v in record.items():
            if k not in ("step", "epoch", "event") and isinstance(v, (int, float)):
                self._tb.add_scalar(prefix + k, v, step)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._tb.close()
            self._fh = None


def _sum_counters(per_table: dict[str, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for counters in per_table.values():
        for k, v in counters.items():
            out[k] = out.get(k, 0) + int(v)
    return out


class Progress:
    """A tqdm bar on a TTY, else a plain line every ``every`` steps (CI logs stay readable)."""

    def __init__(self, mode: str, enabled: bool, total: int | None, every: int = 50) -> None:
        self.enabled = enabled and mode != "none"
        self.every = every
        self.bar = None
        self._t0 = time.perf_counter()
        if self.enabled and (mode == "bar" or (mode == "auto" and sys.stderr.isatty())):
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{samples_per_s:,.0f}")
        elif step % self.every == 0:
            elapsed = time.perf_counter() - self._t0
            print(f"step {step}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s  {elapsed:.0f}s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
