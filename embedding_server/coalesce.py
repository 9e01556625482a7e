"""uvicorn's httptools protocol with a response's head and body sent in one ``write``.

uvicorn writes a response's status line and headers when the app sends
``http.response.start``, and the body when it sends ``http.response.body``: two ``write``
system calls per response on an unbuffered transport, so two TCP segments on the wire and
two wake-ups of the client. ``CoalescingHttpToolsProtocol`` gives uvicorn's own protocol a
transport that collects what is written during one turn of the event loop and passes it on
in one ``write`` at the end of that turn (``loop.call_soon``); ``close`` passes it on first.
Order is kept, and nothing is held past the turn that wrote it, so a streamed response
still goes out as it is produced, one turn's chunks at a time. Everything else (reading,
flow control, TLS, the socket's address) is the real transport's.

Together with the row cache's prefetching it raised the service's keys/s, with one worker
and with two (``recsys bench serve``; the runs: docs/benchmarks-history.md, "Lookup service").
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["CoalescingHttpToolsProtocol"]


class _TurnBufferedTransport:
    """``transport`` whose writes of one event-loop turn leave in one ``write`` (module doc)."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(p) for p in self._pending)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str):  # everything else is the real transport's
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` on a ``_TurnBufferedTransport`` (module doc); pass it
    as ``uvicorn.Config(http=...)``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_TurnBufferedTransport(transport, self.loop))  # type: ignore[arg-type]
