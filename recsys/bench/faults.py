"""``recsys bench faults``: the fault scenarios of training, run for real, with their figures.

Every scenario launches ``recsys train`` (torchrun, gloo, 2 workers unless said) on the tiny
synthetic set (generated under the output directory if missing), injects its fault into the
real processes, and checks what the project promises (RELIABILITY.md):

- ``killed_worker``: SIGKILL one worker at a random step (a seed picks step and rank) under
  ``--max-restarts 2``. Passed when the job finishes, every training row was consumed exactly
  once per epoch (``train.record_rows``), and the final evaluation and the final sparse rows
  equal an uninterrupted run's, at staleness 0 and 1 alike (a checkpoint is a synchronization
  point of the store; the issue asked for AUC within 0.005 at s = 1: exact is stronger).
  Figure: seconds from the kill to the first step after the restart.
- ``hung_worker``: SIGSTOP one worker. The other notices within ``train.collective_timeout_s``
  (20 s here) and exits; torchrun kills the stopped one and restarts both from the last
  checkpoint. Passed as above. Figures: seconds from SIGSTOP to the peer's exit (detection)
  and to the first step after the restart.
- ``checkpoint_crash``: a worker is SIGKILLed at a point of a checkpoint write (the
  checkpoint module's ``RECSYS_FAULT_CHECKPOINT`` hook). Passed when the job resumes once,
  from a complete checkpoint, leaves no temp or half-deleted directory behind and ends
  exactly like the uninterrupted run. Figure: the step it resumed from.
- ``preemption``: SIGTERM to the launcher (what Kubernetes and Slurm send). Passed when it
  exits 0 with a checkpoint of every worker, and the same command resumes and ends exactly
  like the uninterrupted run. Figure: seconds from SIGTERM to the launcher's exit.
- ``spill_outage``: Redis under the spill tier (tables small enough to spill) stops after
  the first checkpoint: the job exits 2 with one line naming the intact checkpoint; Redis
  returns empty and the same command resumes to exactly the uninterrupted run's end.
  Figure: seconds from the Redis stop to the job's exit.
- ``bad_data``: a truncated training file: by default one line naming it (exit 2); with
  ``on_bad_file = "skip"`` the job trains on the other files, each of their rows exactly
  once per epoch, and counts the skipped file in its ``epoch_end`` events.
- ``clear_errors``: a missing data path under ``--nproc 2``: exit code 2 and one line.

A job's processes carry ``RECSYS_TEST_TAG=<tag>`` in their environment, so its workers are
found through ``/proc`` (Linux) and every leftover is killed at the end, orphans included.
Quick: one seed per scenario, 1 epoch; full: several seeds, 2 epochs. No timing assertion anywhere: a scenario passes
or fails on results; the seconds are figures.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "synthetic_tiny.toml"
TAG_ENV = "RECSYS_TEST_TAG"
"""Environment variable marking every process of one launched job (found through /proc)."""

DEADLINE_S = 240.0
"""Longest any one launched job may take before it is called hung."""
EVERY = 10
"""Checkpoint interval (steps) of the scenario jobs."""
EPOCHS = 2
"""Epochs of the scenario jobs (the tests' and the full bench's; --quick runs 1)."""
STEPS_PER_EPOCH = 48  # tiny: 6,000 rows / (2 ranks x 64)


# --------------------------------------------------------------------------- processes


def environ_of(pid: int) -> dict[str, str]:
    """Return the environment a process started with ({} if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw.split(b"\0") if b"=" in kv)


def tagged(tag: str) -> list[int]:
    """Return the pids of live processes started with ``RECSYS_TEST_TAG=tag`` (orphans included)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and environ_of(int(entry.name)).get(TAG_ENV) == tag:
            out.append(int(entry.name))
    return out


def kill_tagged(tag: str) -> None:
    """SIGKILL every live process of the job tagged ``tag``."""
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def workers(tag: str) -> tuple[int, dict[int, int]]:
    """Return the newest torchrun attempt and ``{rank: pid}`` of its ``recsys.train`` workers."""
    found: dict[int, dict[int, int]] = {}
    for pid in tagged(tag):
        env = environ_of(pid)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"recsys.train" in cmdline and "RANK" in env and state != "Z":
            found.setdefault(int(env["TORCHELASTIC_RESTART_COUNT"]), {})[int(env["RANK"])] = pid
    attempt = max(found, default=-1)
    return attempt, found.get(attempt, {})


def records(run_dir: Path) -> list[dict]:
    """Return the run's ``metrics.jsonl`` records (a torn last line is left for later)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def last_step(recs: list[dict]) -> int:
    return max((r["step"] for r in recs if "loss/train" in r), default=0)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something true; raise ``TimeoutError`` naming ``what``."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"gave up after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def job_overrides(data: Path, *extra: str, epochs: int = EPOCHS) -> list[str]:
    """The scenario jobs' settings: tiny data, ``epochs`` epochs, a checkpoint every ``EVERY`` steps."""
    return [
        f"data.train.paths=['{data / 'train'}']",
        f"data.eval.paths=['{data / 'eval'}']",
        "data.train.batch_size=64",
        "data.eval.batch_size=1024",
        "data.train.passthrough=['row_id']",
        "train.record_rows=true",
        "train.log_every=1",
        "train.warmup_steps=0",
        "train.progress='none'",
        f"train.epochs={epochs}",
        f"train.checkpoint_every_steps={EVERY}",
        "train.collective_timeout_s=60",
        *extra,
    ]


@dataclass
class TrainJob:
    """One ``recsys train`` launched as a subprocess, its processes tagged."""

    run_dir: Path
    overrides: list[str]
    nproc: int = 2
    max_restarts: int = 2
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the launcher (and so of its workers)."""

    @property
    def log_path(self) -> Path:
        return self.run_dir.parent / f"{self.run_dir.name}.log"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--nproc", str(self.nproc),
               "--max-restarts", str(self.max_restarts), "--run-dir", str(self.run_dir)]
        for o in self.overrides:
            cmd += ["--set", o]
        return cmd

    def start(self) -> "TrainJob":
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self.command(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                         env={**os.environ, **self.env, TAG_ENV: self.tag})
        return self

    def wait(self, timeout: float = DEADLINE_S) -> int:
        """Wait for the launcher; kill the job and raise ``TimeoutError`` if it takes longer."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the job did not finish in {timeout:.0f}s (hung?):\n{self.log_tail()}") from None
        finally:
            kill_tagged(self.tag)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        kill_tagged(self.tag)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def records(self) -> list[dict]:
        return records(self.run_dir)

    def wait_for_step(self, after: int, attempt: int, timeout: float = DEADLINE_S) -> dict[int, int]:
        """Wait until ``attempt`` of the job wrote a checkpoint and reached step ``after``;
        return its workers ``{rank: pid}``."""
        def reached():
            recs = self.records()
            resumes = [i for i, r in enumerate(recs) if r.get("event") == "resumed"]
            begin = resumes[attempt - 1] if attempt and len(resumes) >= attempt else (0 if not attempt else None)
            if begin is None:
                return self.proc.poll() is not None
            ckpt = any(r.get("event") == "checkpoint" for r in recs[begin:])
            return (ckpt and last_step(recs) >= after) or self.proc.poll() is not None

        wait_for(reached, timeout, f"attempt {attempt}: a checkpoint and step {after}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the job ended before the fault:\n{self.log_tail()}")
        newest, pids = workers(self.tag)
        if newest != attempt or sorted(pids) != list(range(self.nproc)):
            raise RuntimeError(f"expected the {self.nproc} workers of attempt {attempt}, "
                               f"found attempt {newest}: {pids}\n{self.log_tail()}")
        return pids

    def seconds_to_step_after_resume(self, resumes: int, since: float, timeout: float = DEADLINE_S) -> float:
        """Poll until the ``resumes``-th ``resumed`` event is followed by a step; return the
        seconds since ``since`` (a ``time.monotonic()``)."""
        def stepped():
            recs = self.records()
            at = [i for i, r in enumerate(recs) if r.get("event") == "resumed"]
            return len(at) >= resumes and any("loss/train" in r for r in recs[at[resumes - 1]:])

        wait_for(lambda: stepped() or self.proc.poll() is not None, timeout, "the first step after the restart",
                 interval=0.05)
        return time.monotonic() - since


# --------------------------------------------------------------------------- results


def train_row_ids(data: Path) -> np.ndarray:
    import pyarrow.dataset as ds

    return ds.dataset(Path(data) / "train").to_table(columns=["row_id"]).column("row_id").to_numpy()


def train_row_ids_of(path: Path) -> np.ndarray:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["row_id"]).column("row_id").to_numpy()


def final_rows(run_dir: Path) -> dict[str, dict[int, bytes]]:
    """Return ``{table: {key: embedding bytes}}`` of the run's latest checkpoint."""
    from recsys import checkpoint_files

    out = {}
    for name, table in checkpoint_files.load_sparse(checkpoint_files.latest(Path(run_dir) / "checkpoints")).items():
        emb = table.column("embedding").to_numpy(zero_copy_only=False)
        out[name] = {k: np.asarray(e).tobytes() for k, e in zip(table.column("key").to_pylist(), emb)}
    return out


def compare_runs(reference: Path, run_dir: Path, exact: bool, auc_tolerance: float = 0.005) -> dict:
    """Compare a faulted run's result with the uninterrupted one's: exactly (the same final
    evaluation and bit-identical sparse rows) or the final AUC within ``auc_tolerance``."""
    want = json.loads((Path(reference) / "result.json").read_text())
    got = json.loads((Path(run_dir) / "result.json").read_text())
    out = {"auc": got.get("auc"), "reference_auc": want.get("auc"),
           "auc_delta": abs(got.get("auc", float("nan")) - want.get("auc", float("nan")))}
    if exact:
        a, b = final_rows(reference), final_rows(run_dir)
        differing = sum(1 for t in a for k in a[t] if b.get(t, {}).get(k) != a[t][k])
        extra = sum(len(set(b.get(t, {})) - set(a[t])) for t in a) + len(set(b) - set(a))
        out.update(result_equal=got == want, rows_differing=differing + extra)
        out["ok"] = out["result_equal"] and out["rows_differing"] == 0
    else:
        out["ok"] = out["auc_delta"] <= auc_tolerance
    return out


def row_audit(run_dir: Path, data: Path, epochs: int) -> dict:
    from recsys.train.rows import check_exactly_once

    report = check_exactly_once(run_dir, train_row_ids(data), epochs)
    return {"ok": report["ok"], "epochs": {str(e): v for e, v in report["epochs"].items()}}


# --------------------------------------------------------------------------- scenarios


class Scenarios:
    """The scenarios of one bench run, sharing the data and the uninterrupted references."""

    def __init__(self, out: Path, data: Path, epochs: int = EPOCHS) -> None:
        self.out, self.data, self.epochs = out, data, epochs
        self._references: dict[int, Path] = {}

    def overrides(self, *extra: str) -> list[str]:
        return job_overrides(self.data, *extra, epochs=self.epochs)

    def fault_point(self, rng: random.Random) -> tuple[int, int]:
        """Return (a step after the first checkpoint and before the last, a rank)."""
        return rng.randrange(EVERY + 2, self.epochs * STEPS_PER_EPOCH - EVERY), rng.randrange(2)

    def reference(self, staleness: int) -> Path:
        """The uninterrupted run at ``staleness`` (run once)."""
        if staleness not in self._references:
            run_dir = self.out / f"reference-s{staleness}"
            job = TrainJob(run_dir, self.overrides(f"store.staleness={staleness}")).start()
            code = job.wait()
            if code != 0:
                raise RuntimeError(f"the uninterrupted reference run failed ({code}):\n{job.log_tail()}")
            self._references[staleness] = run_dir
        return self._references[staleness]

    def _finish(self, job: TrainJob, staleness: int, details: dict) -> bool:
        code = job.wait()
        details["exit_code"] = code
        if code != 0:
            details["log_tail"] = job.log_tail(1500)
            return False
        details["rows"] = row_audit(job.run_dir, self.data, self.epochs)
        details["result"] = compare_runs(self.reference(staleness), job.run_dir, exact=True)
        details["resumed"] = [r["step"] for r in job.records() if r.get("event") == "resumed"]
        return details["rows"]["ok"] and details["result"]["ok"]

    def killed_worker(self, seed: int, staleness: int = 0) -> dict:
        rng = random.Random(seed)
        at, victim = self.fault_point(rng)
        self.reference(staleness)
        job = TrainJob(self.out / f"killed-s{staleness}-seed{seed}", self.overrides(f"store.staleness={staleness}"))
        details: dict = {"seed": seed, "staleness": staleness, "victim_rank": victim, "kill_after_step": at}
        try:
            pids = job.start().wait_for_step(at, attempt=0)
            os.kill(pids[victim], signal.SIGKILL)
            killed = time.monotonic()
            details["killed_at_step"] = last_step(job.records())
            seconds = job.seconds_to_step_after_resume(1, killed)
        except BaseException:
            job.kill()
            raise
        passed = self._finish(job, staleness, details)
        return {"name": f"killed_worker[s={staleness},seed={seed}]", "passed": passed,
                "figure": {"kill_to_first_step_s": round(seconds, 2)}, "details": details}

    def hung_worker(self, seed: int, timeout_s: float = 20.0) -> dict:
        rng = random.Random(seed)
        at, victim = self.fault_point(rng)
        self.reference(0)
        job = TrainJob(self.out / f"hung-seed{seed}",
                       self.overrides(f"train.collective_timeout_s={timeout_s}"))
        details: dict = {"seed": seed, "victim_rank": victim, "stop_after_step": at, "collective_timeout_s": timeout_s}
        try:
            pids = job.start().wait_for_step(at, attempt=0)
            peer = pids[1 - victim]
            os.kill(pids[victim], signal.SIGSTOP)
            stopped = time.monotonic()
            details["stopped_at_step"] = last_step(job.records())
            wait_for(lambda: peer not in workers(job.tag)[1].values() or job.proc.poll() is not None,
                     DEADLINE_S, "the peer of the stopped worker to exit")
            detected = time.monotonic() - stopped
            seconds = job.seconds_to_step_after_resume(1, stopped)
        except BaseException:
            job.kill()
            raise
        passed = self._finish(job, 0, details)
        return {"name": f"hung_worker[seed={seed}]", "passed": passed,
                "figure": {"detection_s": round(detected, 2), "stop_to_first_step_s": round(seconds, 2)},
                "details": details}

    def preemption(self, seed: int) -> dict:
        rng = random.Random(seed)
        at, _ = self.fault_point(rng)
        self.reference(0)
        run_dir = self.out / f"preempted-seed{seed}"
        job = TrainJob(run_dir, self.overrides())
        details: dict = {"seed": seed, "sigterm_after_step": at}
        try:
            job.start().wait_for_step(at, attempt=0)
            job.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            first = job.wait()
            exited = time.monotonic() - sent
        except BaseException:
            job.kill()
            raise
        details["first_exit_code"] = first
        details["stopped_at_step"] = last_step(job.records())
        again = TrainJob(run_dir, job.overrides)  # the same command
        passed = first == 0 and self._finish(again.start(), 0, details)
        return {"name": f"preemption[seed={seed}]", "passed": passed,
                "figure": {"sigterm_to_exit_s": round(exited, 2)}, "details": details}

    def checkpoint_crash(self, point: str, at_step: int = 2 * EVERY) -> dict:
        """A worker SIGKILLs itself at ``point`` of the save of ``at_step`` (the checkpoint
        module's test hook, first attempt only); torchrun restarts the job, which must resume
        from a complete checkpoint and end exactly like the uninterrupted run."""
        from recsys import checkpoint_files
        from recsys.train.checkpoint import FAULT_ENV

        rank = 0 if point in ("after-marker", "before-latest", "after-latest", "prune") else 1  # rank 0's steps
        self.reference(0)
        job = TrainJob(self.out / f"ckpt-crash-{point}", self.overrides("train.keep_last=1"),
                       env={FAULT_ENV: f"{point}:step={at_step}:rank={rank}"})
        details: dict = {"point": point, "step": at_step, "rank": rank}
        passed = self._finish(job.start(), 0, details)
        resumed = details.get("resumed", [])
        leftovers = sorted(p.name for p in (job.run_dir / "checkpoints").glob(".*-step-*"))
        latest = checkpoint_files.latest(job.run_dir / "checkpoints")
        details.update(leftovers=leftovers, latest=latest.name if latest else None)
        passed = passed and len(resumed) == 1 and resumed[0] in (at_step - EVERY, at_step) and not leftovers
        return {"name": f"checkpoint_crash[{point}]", "passed": passed,
                "figure": {"resumed_from_step": resumed[0] if resumed else None}, "details": details}

    def bad_data(self) -> dict:
        """One training file truncated (a copy of the data): by default the job stops before
        training with one line naming the file (exit 2); with ``data.train.on_bad_file =
        "skip"`` it trains on the other files, every one of their rows exactly once per
        epoch, and its ``epoch_end`` events count the skipped file."""
        import shutil

        from recsys.train.rows import check_exactly_once

        bad = self.out / "bad-data"
        shutil.copytree(self.data, bad)
        files = sorted((bad / "train").glob("*.parquet"))
        victim = files[len(files) // 2]
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        good = np.concatenate([train_row_ids_of(f) for f in files if f != victim])

        stop = TrainJob(self.out / "bad-data-error", job_overrides(bad, epochs=self.epochs)).start()
        code = stop.wait()
        lines = [ln for ln in stop.log_tail().splitlines() if ln.strip()]
        stopped = code == 2 and len(lines) == 1 and victim.name in lines[0]

        skip = TrainJob(self.out / "bad-data-skip",
                        job_overrides(bad, "data.train.on_bad_file='skip'", epochs=self.epochs)).start()
        details: dict = {"file": victim.name, "error_exit_code": code, "error_output": lines[:3],
                         "skip_exit_code": skip.wait()}
        ends = [r for r in skip.records() if r.get("event") == "epoch_end"]
        details["epoch_end"] = ends
        skipped = details["skip_exit_code"] == 0 and len(ends) == self.epochs and all(
            e["skipped_files"] == 1 for e in ends)
        if details["skip_exit_code"] == 0:
            report = check_exactly_once(skip.run_dir, good, self.epochs)
            details["rows"] = {"ok": report["ok"], "epochs": {str(e): v for e, v in report["epochs"].items()}}
            skipped = skipped and report["ok"]
        else:
            details["log_tail"] = skip.log_tail(1500)
        return {"name": "bad_data[truncated file: error, then skip]", "passed": stopped and skipped,
                "figure": {"skipped_files": ends[-1]["skipped_files"] if ends else None,
                           "rows_trained_per_epoch": int(good.size)},
                "details": details}

    def spill_outage(self) -> dict:
        """Redis under the spill tier stops after the first checkpoint of a job whose tables
        spill (``store.spill_outage = "fail"``): the job exits 2 with one line naming the
        intact checkpoint; Redis comes back (empty: no persistence) and the same command
        resumes to exactly the end of the uninterrupted run with the same spill tier."""
        from recsys import checkpoint_files
        from recsys.bench.serve import _start_redis

        workdir = self.out / "spill-redis"
        workdir.mkdir(parents=True, exist_ok=True)
        server, url = _start_redis(workdir)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        small = [f"schema.tables.{t}.capacity={300 if t[0] == 'c' else 1000}"
                 for t in ("c3", "c4", "c7", "c10", "c12", "c15", "c16", "c21", "c24", "c26", "m1", "m2")]
        extra = [f"store.spill_url='{url}'", "store.spill_retries=2", "store.spill_backoff_s=0.02",
                 "store.spill_timeout_s=1.0", *small]
        details: dict = {}
        try:
            ref = TrainJob(self.out / "spill-reference", self.overrides(*extra)).start()
            if ref.wait() != 0:
                raise RuntimeError(f"the uninterrupted spill run failed:\n{ref.log_tail()}")
            job = TrainJob(self.out / "spill-outage", self.overrides(*extra)).start()
            try:
                wait_for(lambda: checkpoint_files.latest(job.run_dir / "checkpoints") is not None
                         or job.proc.poll() is not None, DEADLINE_S, "the first checkpoint")
                server.kill()
                server.wait()
                stopped = time.monotonic()
                code = job.wait()
                exit_s = time.monotonic() - stopped
            except BaseException:
                job.kill()
                raise
            lines = [ln for ln in job.log_tail().splitlines() if ln.startswith("recsys train:")]
            latest = checkpoint_files.latest(job.run_dir / "checkpoints")
            details.update(exit_code=code, output=lines[:3], latest=str(latest))
            one_line = code == 2 and len(lines) == 1 and latest is not None and str(latest) in lines[0]
            server, _ = _start_redis(workdir, port)  # back, empty
            again = TrainJob(job.run_dir, job.overrides).start()
            code2 = again.wait()
            details["resume_exit_code"] = code2
            exact = False
            if code2 == 0:
                details["rows"] = row_audit(job.run_dir, self.data, self.epochs)
                details["result"] = compare_runs(ref.run_dir, job.run_dir, exact=True)
                exact = details["rows"]["ok"] and details["result"]["ok"]
            else:
                details["log_tail"] = again.log_tail(1500)
        finally:
            server.kill()
            server.wait()
        return {"name": "spill_outage[fail, then resume]", "passed": one_line and exact,
                "figure": {"redis_stop_to_exit_s": round(exit_s, 2)}, "details": details}

    def clear_errors(self) -> dict:
        run_dir = self.out / "clear-errors"
        job = TrainJob(run_dir, self.overrides(f"data.train.paths=['{self.data / 'no-such-dir'}']"),
                       max_restarts=2).start()
        code = job.wait()
        lines = [ln for ln in job.log_tail().splitlines() if ln.strip()]
        passed = code == 2 and len(lines) == 1 and "no-such-dir" in lines[0]
        return {"name": "clear_errors[missing data, --nproc 2]", "passed": passed,
                "figure": {"exit_code": code, "lines": len(lines)}, "details": {"output": lines[:5]}}


def measure(quick: bool, data: Path | None) -> dict:
    """Run the scenarios (quick: one seed each); see the module doc."""
    from recsys import synth

    out = ROOT / "bench-out" / ("faults-quick" if quick else "faults")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    if data is None:
        data = ROOT / "bench-out" / "data" / "tiny"
        if not (data / "oracle.json").exists():
            synth.generate("tiny", data, seed=0)
    s = Scenarios(out, Path(data), epochs=1 if quick else EPOCHS)
    seeds = [1] if quick else [1, 2, 3, 4, 5]
    plan = [("killed_worker", (seed, 0)) for seed in seeds]
    plan += [("killed_worker", (seed, 1)) for seed in seeds[:1 if quick else 3]]
    plan += [("hung_worker", (seed,)) for seed in seeds[:1 if quick else 2]]
    plan += [("preemption", (seed,)) for seed in seeds[:1 if quick else 2]]
    points = ["before-latest"] if quick else ["before-sparse", "mid-sparse", "after-sparse", "after-marker",
                                                 "before-latest", "after-latest", "prune"]
    plan += [("checkpoint_crash", (point,)) for point in points]
    plan += [("spill_outage", ()), ("bad_data", ()), ("clear_errors", ())]
    scenarios = []
    for name, args in plan:
        t0 = time.monotonic()
        try:
            result = getattr(s, name)(*args)
        except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a failed scenario, named
            result = {"name": f"{name}{list(args)}", "passed": False, "figure": None, "details": {"error": str(exc)}}
        result["seconds"] = round(time.monotonic() - t0, 1)
        scenarios.append(result)
        print(f"  {'PASS' if result['passed'] else 'FAIL'}  {result['name']}  {json.dumps(result['figure'])}",
              flush=True)
    return {"comparisons": [], "scenarios": scenarios, "passed": all(r["passed"] for r in scenarios),
            "data": str(data), "out": str(out)}
