"""``embedding_server.coalesce``: uvicorn's protocol with one write per event-loop turn.

A recording transport stands in for the socket, so the tests see each ``write`` call: a
response whose head and body the app sends in one turn leaves in one write, a streamed
response leaves one write per turn in order, and a connection closed after its response
has its bytes written before the close. Then a real ``recsys``-style uvicorn server on a
loopback port with the protocol answers keep-alive requests over one connection.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading

import pytest
import uvicorn
from uvicorn.server import ServerState

from embedding_server.coalesce import CoalescingHttpToolsProtocol


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, bytes]] = []
        self.closed = False

    def write(self, data) -> None:
        assert not self.closed, "write after close"
        self.events.append(("write", bytes(data)))

    def close(self) -> None:
        self.events.append(("close", b""))
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def one_shot(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"5"), (b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def streamed(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for part in (b"one", b"two", b"three"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
        await asyncio.sleep(0.01)  # another turn of the loop
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def exchange(app, request: bytes) -> RecordingTransport:
    async def main():
        loop = asyncio.get_running_loop()
        config = uvicorn.Config(app, http=CoalescingHttpToolsProtocol, log_level="warning", lifespan="off")
        protocol = CoalescingHttpToolsProtocol(config, ServerState(), {}, _loop=loop)
        transport = RecordingTransport()
        protocol.connection_made(transport)
        protocol.data_received(request)
        for _ in range(200):  # until the response is out (and, with "close", the connection)
            await asyncio.sleep(0.005)
            if transport.closed or (transport.events and transport.events[-1][1].endswith((b"hello", b"0\r\n\r\n"))):
                break
        await asyncio.sleep(0.02)
        served = RecordingTransport()  # what the server did, before the test's own teardown
        served.events, served.closed = list(transport.events), transport.closed
        protocol.connection_lost(None)
        return served

    return asyncio.run(main())


def test_a_response_sent_in_one_turn_is_one_write():
    t = exchange(one_shot, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    writes = [data for kind, data in t.events if kind == "write"]
    assert len(writes) == 1, writes
    head, _, body = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 5" in head and body == b"hello"
    assert not t.closed  # keep-alive


def test_a_streamed_response_leaves_turn_by_turn_in_order():
    t = exchange(streamed, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    writes = [data for kind, data in t.events if kind == "write"]
    assert len(writes) >= 3  # not held back until the end
    assert b"".join(writes).endswith(b"3\r\none\r\n3\r\ntwo\r\n5\r\nthree\r\n0\r\n\r\n")
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in writes[0]


def test_connection_close_writes_the_response_before_closing():
    t = exchange(one_shot, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert [kind for kind, _ in t.events][:2] == ["write", "close"]
    assert all(kind == "close" for kind, _ in t.events[1:])  # uvicorn may close twice; nothing written after
    assert t.events[0][1].endswith(b"\r\n\r\nhello")


def test_a_real_server_answers_keep_alive_requests_on_one_connection():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(one_shot, host="127.0.0.1", port=port, http=CoalescingHttpToolsProtocol,
                            log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            threading.Event().wait(0.01)
        assert server.started
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for i in range(20):
            conn.request("POST", "/", body=b"x" * i)
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"hello")
        conn.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.parametrize("name", ["get_extra_info", "pause_reading", "is_closing"])
def test_the_rest_is_the_real_transports(name):
    from embedding_server.coalesce import _TurnBufferedTransport

    real = RecordingTransport()
    loop = asyncio.new_event_loop()
    try:
        assert getattr(_TurnBufferedTransport(real, loop), name) == getattr(real, name)
    finally:
        loop.close()
