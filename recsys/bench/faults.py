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
- ``hung_worker``: SIGSTOP one worker. The other notices within ``train.runtime.collective_timeout_s``
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
  returns empty and the same command resumes to exactly the uninterrupted run's end (the run
  without spilling: a spilled row comes back bit-exact). Figure: seconds from the Redis stop
  to the job's exit.
- ``bad_data``: a truncated training file: by default one line naming it (exit 2); with
  ``on_bad_file = "skip"`` the job trains on the other files, each of their rows exactly
  once per epoch, and counts the skipped file in its ``epoch_end`` events.
- ``clear_errors``: a missing data path under ``--nproc 2``: exit code 2 and one line.
- ``elastic_nodes``: two agents on loopback (``--nnodes 1:2``, one worker each). One node is
  SIGKILLed with its worker: the other goes on at world size 1 from the last checkpoint; a
  new node joins: the job grows back to 2 from the checkpoint torchrun's stop made. Passed
  when every row is consumed exactly once per epoch (and, full run, the trajectory equals the
  same world sizes trained as clean stages, step by step). Figures: seconds from the kill
  and from the join to the first step after, rows lost and repeated.
- ``resize``: 2 → 1 → 3 workers by SIGTERM and the same command with another ``--nproc``.
  Passed as ``elastic_nodes``. Figures: seconds from SIGTERM to exit and from each launch to
  its first step, rows lost and repeated.

A job's processes carry ``RECSYS_TEST_TAG=<tag>`` in their environment, so its workers are
found through ``/proc`` (Linux) and every leftover is killed at the end, orphans included.
Quick: one seed per scenario, 1 epoch, no staged references; full: several seeds, 2
epochs. No timing assertion anywhere: a scenario passes or fails on results; the seconds
are figures.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np

from recsys.testing.faults import (EPOCHS, EVERY, STEPS_PER_EPOCH, compare_runs, job_overrides, leave_and_join,
                                   row_audit, rows_lost_and_repeated, same_training, spilling_overrides,
                                   staged_reference, stop_and_resume, train_row_ids_of)
from recsys.testing.harness import DEADLINE_S, ROOT, TrainJob, last_step, start_redis, wait_for, workers


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
                       self.overrides(f"train.runtime.collective_timeout_s={timeout_s}"))
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
        from recsys.checkpoint import read as checkpoint_files
        from recsys.checkpoint.write import FAULT_ENV

        rank = 0 if point in ("after-marker", "before-latest", "after-latest", "prune") else 1  # rank 0's steps
        self.reference(0)
        job = TrainJob(self.out / f"ckpt-crash-{point}", self.overrides("train.checkpoint.keep_last=1"),
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
        spill (``store.spill.outage = "fail"``): the job exits 2 with one line naming the
        intact checkpoint; Redis comes back (empty: no persistence) and the same command
        resumes to exactly the end of the uninterrupted run, the one whose tables are large
        enough never to spill (a spilled row comes back bit-exact with its optimizer state)."""
        from recsys.checkpoint import read as checkpoint_files

        workdir = self.out / "spill-redis"
        workdir.mkdir(parents=True, exist_ok=True)
        server = start_redis(workdir)
        url, port = server.url, server.port
        extra = spilling_overrides(url)
        details: dict = {}
        try:
            reference = self.reference(0)  # spilling is exact: the same end as with every row in memory
            job = TrainJob(self.out / "spill-outage", self.overrides(*extra)).start()
            try:
                wait_for(lambda: checkpoint_files.latest(job.run_dir / "checkpoints") is not None
                         or job.proc.poll() is not None, DEADLINE_S, "the first checkpoint")
                server.proc.kill()
                server.proc.wait()
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
            server = start_redis(workdir, port=port)  # back, empty
            again = TrainJob(job.run_dir, job.overrides).start()
            code2 = again.wait()
            details["resume_exit_code"] = code2
            exact = False
            if code2 == 0:
                details["rows"] = row_audit(job.run_dir, self.data, self.epochs)
                details["result"] = compare_runs(reference, job.run_dir, exact=True)
                exact = details["rows"]["ok"] and details["result"]["ok"]
            else:
                details["log_tail"] = again.log_tail(1500)
        finally:
            server.proc.kill()
            server.proc.wait()
        return {"name": "spill_outage[fail, then resume]", "passed": one_line and exact,
                "figure": {"redis_stop_to_exit_s": round(exit_s, 2)}, "details": details}

    def elastic_nodes(self, cycles: int, exact: bool) -> dict:
        """Two agents on loopback (one worker each, ``--nnodes 1:2``); ``cycles`` times: one
        node is SIGKILLed with its worker, the other goes on at world size 1 from the last
        checkpoint, a new node joins and the job grows back to 2. Passed when both changes
        resume from the right checkpoint, the job finishes, every row is consumed exactly once
        per epoch and (``exact``) the run equals the same world-size schedule trained as clean
        stages: the optimizer state and reader position were carried exactly."""
        # smaller batches: enough steps per epoch for the changes; few periodic checkpoints
        sets = self.overrides("data.train.batch_size=16", "train.log_every=2", "train.runtime.threads=1",
                              f"train.checkpoint.every_steps={25 if cycles == 1 else EVERY}")
        run_dir = self.out / f"elastic-{cycles}"
        figures = leave_and_join(run_dir, sets, cycles)
        # node a may train alone until b joins: then the trajectory starts at world size 1
        allowed = ([2, 1] * cycles + [2], [1] + [2, 1] * cycles + [2])
        return self._membership(f"elastic_nodes[{cycles} leave+join{', exact' if exact else ''}]", run_dir, sets,
                                figures, allowed, exact,
                                {"resume_after_leave_s": figures["resume_after_leave_s"],
                                 "resume_after_join_s": figures["resume_after_join_s"]})

    def resize(self, sizes: list[int], exact: bool) -> dict:
        """Stop-and-resume through the world sizes ``sizes``: SIGTERM to the launcher, the same
        command with the next ``--nproc``. Passed as ``elastic_nodes``."""
        sets = self.overrides("data.train.batch_size=32", "train.log_every=2", "train.runtime.threads=1",
                              "train.checkpoint.every_steps=0")  # SIGTERM makes the checkpoints
        run_dir = self.out / f"resize-{'-'.join(map(str, sizes))}"
        figures = stop_and_resume(run_dir, sets, sizes, 12 if self.epochs == 1 else 60)  # a change in each epoch
        return self._membership(f"resize[{' -> '.join(map(str, sizes))} by stop and resume"
                                f"{', exact' if exact else ''}]", run_dir, sets, figures, (sizes,), exact,
                                {"sigterm_to_exit_s": figures["stop_s"], "launch_to_first_step_s": figures["resume_s"]})

    def _membership(self, name: str, run_dir: Path, sets: list[str], figures: dict, allowed: tuple, exact: bool,
                    figure: dict) -> dict:
        """The result of a membership scenario: the world sizes of its final trajectory among
        ``allowed``, rows exactly once per epoch, and (``exact``) equal to the staged reference."""
        worlds = [w for _, w in figures["trajectory"]]
        details: dict = {"trajectory": figures["trajectory"], "rows": row_audit(run_dir, self.data, self.epochs)}
        passed = worlds in [list(a) for a in allowed] and details["rows"]["ok"]
        if exact:
            staged = run_dir.with_name(run_dir.name + "-staged")
            staged_reference(staged, sets, figures["trajectory"])
            details["result"] = same_training(staged, run_dir)
            passed = passed and details["result"]["ok"]
        return {"name": name, "passed": passed, "figure": {**figure, **rows_lost_and_repeated(details["rows"])},
                "details": details}

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
    from recsys.io import synth

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
    plan += [("elastic_nodes", (1, False) if quick else (2, True)), ("resize", ([2, 1, 3], not quick))]
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
