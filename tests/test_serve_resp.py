"""The lean MGET client: AUTH and SELECT from the URL, errors as redis-py's, recovery after a restart."""

from __future__ import annotations

import asyncio

import pytest
import redis

from embedding_server.resp import RespPool
from recsys.harness import start_redis

pytestmark = pytest.mark.redis


def test_mget_with_password_and_db(tmp_path):
    server = start_redis(tmp_path / "r", "--requirepass", "pw")
    try:
        direct = redis.Redis(port=server.port, password="pw", db=2)
        direct.mset({b"a": b"1", b"c": b"\x00\xff" * 100})
        redis.Redis(port=server.port, password="pw", db=0).set(b"a", b"other db")

        async def run():
            pool = RespPool(f"redis://:pw@127.0.0.1:{server.port}/2", timeout_s=5)
            try:
                got = await pool.mget([b"a", b"b", b"c"])
                again = await pool.mget([b"c"])  # on the pooled connection
                return got, again
            finally:
                pool.close()

        got, again = asyncio.run(run())
        assert got == [b"1", None, b"\x00\xff" * 100] and again == [b"\x00\xff" * 100]

        async def wrong():
            pool = RespPool(f"redis://:nope@127.0.0.1:{server.port}/0", timeout_s=5)
            await pool.mget([b"a"])

        with pytest.raises(redis.ResponseError):
            asyncio.run(wrong())
    finally:
        server.stop()


def test_a_restarted_server_costs_one_failed_call(tmp_path):
    server = start_redis(tmp_path / "r")
    try:
        redis.Redis(port=server.port).set(b"k", b"v")

        async def run():
            pool = RespPool(f"redis://127.0.0.1:{server.port}/0", timeout_s=5)
            await asyncio.gather(*(pool.mget([b"k"]) for _ in range(4)))  # four idle connections
            server.restart()
            redis.Redis(port=server.port).set(b"k", b"v2")
            with pytest.raises((redis.ConnectionError, OSError)):
                await pool.mget([b"k"])
            value = await pool.mget([b"k"])  # the dead idle connections were dropped
            pool.close()
            return value

        assert asyncio.run(run()) == [b"v2"]
    finally:
        server.stop()
