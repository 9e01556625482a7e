"""The lean MGET client: AUTH and SELECT from the URL, errors as redis-py's, one pipelined
connection, its timeout, callers cancelled mid-flight, recovery after a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import hiredis
import pytest
import redis

from embedding_server import redis_mget as resp
from embedding_server.redis_mget import RespPipeline
from recsys.testing.harness import start_redis

pytestmark = pytest.mark.redis


@pytest.fixture
def server(tmp_path):
    s = start_redis(tmp_path / "r")
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            os.kill(s.proc.pid, signal.SIGCONT)  # should a test have stopped it
        s.stop()


def _connections(r: redis.Redis) -> int:
    """Connections the server has accepted (``r`` keeps its own one open)."""
    return int(r.info("stats")["total_connections_received"])


def test_mget_with_password_and_db(tmp_path):
    server = start_redis(tmp_path / "r", "--requirepass", "pw")
    try:
        direct = redis.Redis(port=server.port, password="pw", db=2)
        direct.mset({b"a": b"1", b"c": b"\x00\xff" * 100})
        redis.Redis(port=server.port, password="pw", db=0).set(b"a", b"other db")

        async def run():
            pool = RespPipeline(f"redis://:pw@127.0.0.1:{server.port}/2", timeout_s=5)
            try:
                got = await pool.mget([b"a", b"b", b"c"])
                again = await pool.mget([b"c"])  # on the same connection
                return got, again
            finally:
                pool.close()

        got, again = asyncio.run(run())
        assert got == [b"1", None, b"\x00\xff" * 100] and again == [b"\x00\xff" * 100]

        async def wrong():
            pool = RespPipeline(f"redis://:nope@127.0.0.1:{server.port}/0", timeout_s=5)
            await pool.mget([b"a"])

        with pytest.raises(redis.ResponseError):
            asyncio.run(wrong())
    finally:
        server.stop()


def test_concurrent_calls_share_one_connection_and_get_their_own_replies(server, monkeypatch):
    monkeypatch.setattr(resp, "MGET_KEYS", 7)  # the long call is split into several MGETs
    r = redis.Redis(port=server.port)
    r.mset({f"k{i}".encode(): f"v{i}".encode() for i in range(100)})
    asks = [[f"k{(7 * j + i) % 130}".encode() for i in range(j + 1)] for j in range(40)]
    asks.append([f"k{i}".encode() for i in range(120)])
    before = _connections(r)

    async def run():
        pool = RespPipeline(f"redis://127.0.0.1:{server.port}/0", timeout_s=5)
        try:
            return await asyncio.gather(*(pool.mget(a) for a in asks))
        finally:
            pool.close()

    got = asyncio.run(run())
    assert _connections(r) - before == 1
    for ask, values in zip(asks, got):
        assert values == [r.get(k) for k in ask]


def test_a_stuck_server_times_out_and_the_next_call_reconnects(server):
    r = redis.Redis(port=server.port)
    r.set(b"k", b"v")
    before = _connections(r)

    async def run():
        pool = RespPipeline(f"redis://127.0.0.1:{server.port}/0", timeout_s=0.5)
        assert await pool.mget([b"k"]) == [b"v"]
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            calls = [asyncio.ensure_future(pool.mget([b"k"])) for _ in range(3)]
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            waited = time.monotonic() - t0
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        value = await pool.mget([b"k"])
        pool.close()
        return outcomes, waited, value

    outcomes, waited, value = asyncio.run(run())
    assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes
    assert "did not answer within 0.5 s" in str(outcomes[0])
    assert waited >= 0.5
    assert value == [b"v"]
    assert _connections(r) - before == 2  # the stuck connection was dropped, a new one opened


def test_a_caller_cancelled_in_flight_leaves_the_others_replies_in_place(server):
    r = redis.Redis(port=server.port)
    r.mset({b"a": b"1", b"b": b"2", b"c": b"3", b"d": b"4"})

    async def run():
        pool = RespPipeline(f"redis://127.0.0.1:{server.port}/0", timeout_s=5)
        assert await pool.mget([b"d"]) == [b"4"]  # connected
        os.kill(server.proc.pid, signal.SIGSTOP)  # the three calls are sent, their replies held
        try:
            calls = [asyncio.ensure_future(pool.mget([k])) for k in (b"a", b"b", b"c")]
            await asyncio.sleep(0.05)
            calls[1].cancel()
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        first, third = await calls[0], await calls[2]
        after = await pool.mget([b"b", b"d"])  # on the same connection, after the skipped reply
        pool.close()
        return first, calls[1].cancelled(), third, after

    assert asyncio.run(run()) == ([b"1"], True, [b"3"], [b"2", b"4"])


def test_a_restarted_server_costs_at_most_the_calls_in_flight(server):
    redis.Redis(port=server.port).set(b"k", b"v")

    async def run():
        pool = RespPipeline(f"redis://127.0.0.1:{server.port}/0", timeout_s=5)
        assert await pool.mget([b"k"]) == [b"v"]
        server.restart()
        redis.Redis(port=server.port).set(b"k", b"v2")
        try:
            await pool.mget([b"k"])  # fails if it went out before the client saw the old connection close
        except redis.ConnectionError:
            pass
        value = await pool.mget([b"k"])  # a new connection
        pool.close()
        return value

    assert asyncio.run(run()) == [b"v2"]


def test_a_closed_server_fails_with_a_connection_error(server):
    async def run():
        pool = RespPipeline(f"redis://127.0.0.1:{server.port}/0", timeout_s=5)
        await pool.mget([b"k"])
        server.stop()
        with pytest.raises((redis.ConnectionError, OSError)):
            await pool.mget([b"k"])
        with pytest.raises((redis.ConnectionError, OSError)):  # and again, while nothing listens
            await pool.mget([b"k"])
        pool.close()

    asyncio.run(run())


def test_an_error_reply_in_the_pipeline_fails_only_its_own_call(server):
    redis.Redis(port=server.port).mset({b"a": b"1", b"c": b"3"})

    async def run():
        pool = RespPipeline(f"redis://127.0.0.1:{server.port}/0", timeout_s=5)
        assert await pool.mget([b"c"]) == [b"3"]  # connected
        first = asyncio.ensure_future(pool.mget([b"a"]))
        await asyncio.sleep(0)  # its MGET is queued in this turn
        wrong = pool._pipe.send(("GET",))  # an error reply between two good ones, in the same write
        last = asyncio.ensure_future(pool.mget([b"a", b"c"]))
        outcomes = await asyncio.gather(first, wrong, last, return_exceptions=True)
        pool.close()
        return outcomes

    first, wrong, last = asyncio.run(run())
    assert first == [b"1"] and last == [b"1", b"3"]
    assert isinstance(wrong, redis.ResponseError) and "wrong number of arguments" in str(wrong)


class _MovableClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock a test moves forward (``jump``) on top of real time, so a
    timeout is checked against the time the test says has passed, whatever the host's load."""

    offset = 0.0

    def time(self) -> float:
        return super().time() + self.offset


def _run_on_movable_clock(coro):
    with asyncio.Runner(loop_factory=_MovableClockLoop) as runner:
        return runner.run(coro)


async def _gated_server():
    """A server that answers AUTH with +OK once ``release`` is set, and nothing else, ever;
    ``auth_seen`` / ``mget_seen``: it received an AUTH / an MGET."""
    auth_seen, release, mget_seen = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def handle(reader, writer):
        parser = hiredis.Reader()
        try:
            while data := await reader.read(1 << 16):
                parser.feed(data)
                while (cmd := parser.gets()) is not False:
                    if cmd[0].upper() == b"AUTH":
                        auth_seen.set()
                        await release.wait()
                        writer.write(b"+OK\r\n")
                    elif cmd[0].upper() == b"MGET":
                        mget_seen.set()
        finally:
            writer.close()  # also when the test's loop ends and cancels this

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], auth_seen, release, mget_seen


def test_a_call_that_must_connect_first_waits_no_longer_than_the_timeout():
    timeout = 100.0

    async def run():
        loop = asyncio.get_running_loop()
        srv, port, auth_seen, release, mget_seen = await _gated_server()
        pool = RespPipeline(f"redis://:pw@127.0.0.1:{port}/0", timeout_s=timeout)
        call = asyncio.ensure_future(pool.mget([b"k"]))
        await auth_seen.wait()  # the open is under way, held at AUTH
        loop.offset += 0.8 * timeout  # the open took 80 % of the timeout
        release.set()
        await mget_seen.wait()  # connected: the MGET went out, and is never answered
        loop.offset += 0.1 * timeout  # 90 % since the call began
        await asyncio.sleep(0.01)
        pending_before_the_timeout = not call.done()
        loop.offset += 0.2 * timeout  # 110 %: past one timeout, long before the open plus a timeout (180 %)
        done, _ = await asyncio.wait([call], timeout=0.05 * timeout)
        outcome = call.exception() if done else None
        pool.close()
        srv.close()
        return pending_before_the_timeout, outcome

    pending_before_the_timeout, outcome = _run_on_movable_clock(run())
    assert pending_before_the_timeout
    assert isinstance(outcome, TimeoutError), outcome  # the open and the reply share one timeout


def test_close_while_connecting_fails_the_waiting_calls_with_a_connection_error():
    async def run():
        srv, port, auth_seen, _release, _ = await _gated_server()
        pool = RespPipeline(f"redis://:pw@127.0.0.1:{port}/0", timeout_s=30)
        calls = [asyncio.ensure_future(pool.mget([b"k"])) for _ in range(2)]
        await auth_seen.wait()  # both wait for the one open, held at AUTH
        await asyncio.sleep(0)
        pool.close()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        with pytest.raises(redis.ConnectionError, match="closed"):
            await pool.mget([b"k"])  # closed for good
        srv.close()
        return outcomes

    outcomes = asyncio.run(run())
    assert all(isinstance(o, redis.ConnectionError) and "closed" in str(o) for o in outcomes), outcomes
