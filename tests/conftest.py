"""Shared fixtures: a real redis-server on a free port, and free ports for process groups."""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from recsys.spawn import free_port  # noqa: F401 - the tests import it from here


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes (then ``TimeoutError``)."""
    from recsys.bench.faults import wait_for

    return wait_for(predicate, timeout, what, interval)


@dataclass
class RedisServer:
    """A redis-server process owned by a test."""

    host: str
    port: int
    proc: subprocess.Popen
    workdir: Path
    cmd: list[str]
    tls: bool = False

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
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.ping, 10, f"redis-server to answer PING again on port {self.port}")

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


def start_redis(workdir: Path, *args: str, tls_port: bool = False) -> RedisServer:
    """Start a non-persistent redis-server on a free loopback port and wait until it answers.

    ``args``: more redis-server options (e.g. cluster mode). ``tls_port``: the port speaks
    TLS only (``args`` name the certificates); then "answers" means it accepts connections."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `make test` (it installs it) or "
                    "`sudo apt-get install -y redis-server`")
    workdir.mkdir(parents=True, exist_ok=True)
    last_error = ""
    for _ in range(5):  # a port can be taken between probing and binding
        port = _redis_port("--cluster-enabled" in args)
        ports = ["--port", "0", "--tls-port", str(port)] if tls_port else ["--port", str(port)]
        cmd = [binary, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(workdir), "--logfile", str(workdir / "redis.log"), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = RedisServer("127.0.0.1", port, proc, workdir, cmd, tls_port)
        try:
            wait_until(lambda: server.ping() or proc.poll() is not None, 10, "redis-server to answer PING")
        except TimeoutError as exc:
            last_error = str(exc)
        if proc.poll() is None and server.ping():
            return server
        server.stop()
        log = workdir / "redis.log"
        last_error = log.read_text()[-500:] if log.exists() else last_error
    pytest.fail(f"could not start redis-server: {last_error}")


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server for one test; stopped afterwards."""
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """The tiny synthetic data set (seed 0), generated once per session; tests only read it."""
    from recsys import synth

    out = tmp_path_factory.mktemp("tiny")
    synth.generate("tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A run directory trained on the tiny synthetic set (1 process, staleness 0)."""
    from serving_data import train_tiny

    return train_tiny(tmp_path_factory.mktemp("tiny_run"))


def pytest_collection_modifyitems(config, items):
    """Skip the ``cuda``-marked tests where torch sees no GPU (this machine, CI)."""
    cuda = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda:
        return
    import torch

    if torch.cuda.is_available():
        return
    why = "no CUDA GPU visible" if torch.version.cuda else "torch built without CUDA"
    for item in cuda:
        item.add_marker(pytest.mark.skip(reason=f"cuda: {why}"))
