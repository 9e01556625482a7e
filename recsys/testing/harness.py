"""The harness the tests and the benchmarks share: processes launched and found again,
Redis and lookup-service starters, waits, and a run's records.

- ``TrainJob``: one ``recsys train`` as a subprocess. Every process of it (launcher,
  torchrun's agent, workers) carries ``RECSYS_TEST_TAG=<tag>`` in its environment, so
  ``tagged`` finds them through ``/proc`` (Linux) and ``kill_tagged`` kills the leftovers,
  orphans included; ``workers`` names the ranks of its newest torchrun attempt.
- ``start_redis``: a redis-server without persistence on a free loopback port
  (``RedisServer``: ``ping``, ``stop``, ``restart`` on the same port); ``start_service``:
  ``recsys serve`` on a free port, once ready; ``stop_process``.
- ``wait_for``: poll until true, else a ``TimeoutError`` naming what it waited for.
- ``records``, ``last_step``, ``losses``: a run's ``metrics.jsonl``; ``final_rows``: the
  sparse rows of its latest checkpoint.

Free ports come from ``recsys.runtime.spawn.free_port``. No torch and no pytest here: a failure is
an exception whose message says why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recsys.runtime.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "synthetic_tiny.toml"
TAG_ENV = "RECSYS_TEST_TAG"
"""Environment variable marking every process of one launched job (found through /proc)."""
DEADLINE_S = 240.0
"""Longest any one launched job may take before it is called hung."""


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
    name: str = ""
    """Names the log when several launchers share a run directory (the nodes of one job)."""
    launcher_args: list[str] = field(default_factory=list)
    """Extra ``recsys train`` flags (the multi-node ones)."""

    @property
    def log_path(self) -> Path:
        return self.run_dir.parent / f"{self.run_dir.name}{'-' + self.name if self.name else ''}.log"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--nproc", str(self.nproc),
               "--max-restarts", str(self.max_restarts), "--run-dir", str(self.run_dir), *self.launcher_args]
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


# --------------------------------------------------------------------------- servers


@dataclass
class RedisServer:
    """A redis-server process owned by a test or a benchmark."""

    host: str
    port: int
    proc: subprocess.Popen
    workdir: Path
    cmd: list[str]
    tls: bool = False
    nice: int = 0

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                if self.tls:  # a TLS port: accepting connections is all a plain socket can see
                    return True
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # a password server answers too
        except OSError:
            return False

    def restart(self) -> None:
        """Start the server again on the same port (after ``stop``) and wait until it answers."""
        self.stop()
        self.proc = _popen_quiet(self.cmd, self.nice)
        wait_for(self.ping, 10, f"redis-server to answer PING again on port {self.port}", interval=0.02)

    def stop(self) -> None:
        """Stop the server (an outage, as far as clients can tell)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _redis_port(cluster: bool) -> int:
    """Return a free port (and, for a cluster node, a free cluster bus port at port + 10000)."""
    while True:
        port = free_port()
        if not cluster or (port + 10000 < 65536 and _port_is_free(port + 10000)):
            return port


def _popen_quiet(cmd: list[str], nice: int) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


def start_redis(workdir: Path, *args: str, tls_port: bool = False, port: int | None = None,
                nice: int = 0) -> RedisServer:
    """Start a non-persistent redis-server on a free loopback port and wait until it answers.

    ``args``: more redis-server options (e.g. cluster mode). ``tls_port``: the port speaks
    TLS only (``args`` name the certificates); then "answers" means it accepts connections.
    ``port``: this port instead of a free one (a server back on its old port). ``nice``: the
    server's nice value above this process's. ``RuntimeError`` if it does not start."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run `make test` (it installs it) or "
                           "`sudo apt-get install -y redis-server`")
    workdir.mkdir(parents=True, exist_ok=True)
    last_error = ""
    for _ in range(5):  # a port can be taken between probing and binding
        chosen = port or _redis_port("--cluster-enabled" in args)
        ports = ["--port", "0", "--tls-port", str(chosen)] if tls_port else ["--port", str(chosen)]
        cmd = [binary, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(workdir), "--logfile", str(workdir / "redis.log"), *args]
        proc = _popen_quiet(cmd, nice)
        server = RedisServer("127.0.0.1", chosen, proc, workdir, cmd, tls_port, nice)
        try:
            wait_for(lambda: server.ping() or proc.poll() is not None, 10, "redis-server to answer PING",
                     interval=0.02)
        except TimeoutError as exc:
            last_error = str(exc)
        if proc.poll() is None and server.ping():
            return server
        server.stop()
        log = workdir / "redis.log"
        last_error = log.read_text()[-500:] if log.exists() else last_error
    raise RuntimeError(f"could not start redis-server: {last_error}")


def start_service(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """Start ``recsys serve ARGS`` on a free port (its output to ``log``); return it and its URL once
    ``/readyz`` answers 200 (``RuntimeError`` if it exits or takes over 300 s)."""
    port = free_port()
    cmd = [sys.executable, "-m", "recsys.cli", "serve", *args, "--port", str(port)]
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"the lookup service did not become ready; see {log}")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` and wait for it (SIGKILL after 20 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- a run's records


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


def losses(run_dir: Path) -> dict[int, float]:
    """``{step: training loss}``; a step logged again after a roll-back keeps its last value."""
    return {r["step"]: r["loss/train"] for r in records(run_dir) if "loss/train" in r}


def final_rows(run_dir: Path) -> dict[str, dict[int, bytes]]:
    """Return ``{table: {key: embedding bytes}}`` of the run's latest checkpoint."""
    from recsys.checkpoint import read as checkpoint_files

    out = {}
    for name, table in checkpoint_files.load_sparse(checkpoint_files.latest(Path(run_dir) / "checkpoints")).items():
        emb = table.column("embedding").to_numpy(zero_copy_only=False)
        out[name] = {k: np.asarray(e).tobytes() for k, e in zip(table.column("key").to_pylist(), emb)}
    return out
