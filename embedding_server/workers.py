"""``recsys serve --workers N`` (N > 1): N uvicorn processes, each listening on a socket of its own.

uvicorn's own supervisor binds one socket and hands it to every worker, so each new
connection goes to whichever worker accepts first, and connections opened in a burst (a
client's pool starting up) land mostly on one of them. Measured with 2 workers: a load
generator's 8 connections split 8/0, 2/6, 5/3, 4/4 and 8/0 in five runs, and 32 split 2/30
and 26/6, while the other worker idled. Here every worker opens its own listening socket on
the port with ``SO_REUSEPORT``, and the kernel hands each new connection to one of them by
a hash of its addresses, whichever worker is awake: a burst spreads evenly in expectation.

The parent holds the port (bound, never listening, so it takes no connection): a port in
use fails before any worker starts. It starts the workers, starts another in place of one
that dies after it served (a ``kill -9``, an out-of-memory kill), stops them all on SIGTERM
or SIGINT (SIGTERM each: uvicorn's graceful shutdown; killed after ``STOP_S``), and stops
everything, exiting with the worker's code, when one dies before it served (say, a
checkpoint it cannot load): another would fail the same way. Linux, macOS and the BSDs have
``SO_REUSEPORT``; elsewhere ``--workers`` above 1 is refused.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import time

__all__ = ["listen_socket", "run_workers"]

log = logging.getLogger(__name__)

STOP_S = 30.0
"""Seconds the workers get to finish after SIGTERM before they are killed."""

STARTUP_FAILURE = 3
"""uvicorn's exit code for a server whose startup (the app's lifespan) failed; the service's
when a worker died before it served without a code of its own."""


def listen_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """Return a TCP socket bound to (``host``, ``port``) with ``SO_REUSEPORT``, listening unless
    ``listen`` is false (``OSError`` if another socket without it holds the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def _worker(host: str, port: int, uvicorn_args: dict, ready) -> None:
    """One worker (a spawned process): the app from the ``RECSYS_SERVE_*`` environment on a
    listening socket of its own; sets ``ready`` once it serves."""
    import threading

    import uvicorn

    config = uvicorn.Config("embedding_server.app:create_app_from_env", factory=True, host=host, port=port,
                            **uvicorn_args)
    server = uvicorn.Server(config)

    def watch() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            ready.set()

    threading.Thread(target=watch, daemon=True).start()
    server.run(sockets=[listen_socket(host, port)])
    if not server.started:  # as uvicorn.run exits when its one server's startup failed
        raise SystemExit(STARTUP_FAILURE)


def run_workers(workers: int, host: str, port: int, uvicorn_args: dict) -> int:
    """Run ``workers`` worker processes on (``host``, ``port``) until SIGTERM or SIGINT (see the
    module doc); return 0, or the exit code of a worker whose startup failed."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise RuntimeError("--workers above 1 needs SO_REUSEPORT, which this platform lacks; run one worker")
    holder = listen_socket(host, port, listen=False)
    port = holder.getsockname()[1]  # port 0: the one the system gave, the same for every worker
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: no state forked from here
    stopping: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: stopping.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}

    def start():
        ready = ctx.Event()
        proc = ctx.Process(target=_worker, args=(host, port, uvicorn_args, ready), name="recsys-serve-worker")
        proc.start()
        return proc, ready

    code = 0
    procs = []
    try:
        procs = [start() for _ in range(workers)]
        while not stopping and not code:
            for i, (proc, ready) in enumerate(procs):
                if proc.is_alive():
                    continue
                if not ready.is_set():  # it never served: another would fail the same way
                    log.error("worker %d (pid %s) exited with code %s before it served (its error is above): "
                              "stopping the service", i, proc.pid, proc.exitcode)
                    code = proc.exitcode if proc.exitcode and proc.exitcode > 0 else STARTUP_FAILURE
                    break
                log.warning("worker %d (pid %s) exited with code %s: starting another", i, proc.pid, proc.exitcode)
                procs[i] = start()
            time.sleep(0.2)
    finally:
        for proc, _ in procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + STOP_S
        for proc, _ in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        holder.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code
