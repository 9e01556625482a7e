"""Redis commands packed as arrays, and sent on one pooled connection: the spill tier's
(``recsys.store.spill.tier``) and the live writer's (``recsys.train.live_writer``).

Legend: ``N`` keys, ``W`` bytes of a Redis name, ``V`` bytes of a value, ``B`` keys per command.

Every name a caller sends in one run has the same length (a prefix and fixed-width digits)
and every value too (one fixed-size record), so a run of ``MSET name value name value ...``
(or ``UNLINK`` / ``MGET name name ...``) commands is one fixed-stride array of bytes: the RESP
framing of a key (``$W\\r\\n<name>\\r\\n`` and ``$V\\r\\n<value>\\r\\n``: ``bulk``) is filled
for all N keys at once, and each command adds a short header (``pack``). redis-py packs a
command argument by argument in Python (the largest part of the spill writer thread's CPU in
a profile of ``recsys bench scale``, and of a live push's); this is a few numpy copies. A
command of a few arguments is ``command``; other layouts (the live writer's ``EVALSHA``) are
built from ``bulk`` and ``bulks``.

``call`` sends packed commands on one of the client's pooled connections (``connection``), a
window of them at a time, and reads their replies in order (parsed by the connection's
reader: hiredis when installed). A connection that failed in between is dropped, not reused,
so no reply is ever read by the wrong call. Errors are redis-py's (``ConnectionError``,
``TimeoutError``, ``ResponseError``, the last returned as a reply with ``errors_as_values``):
the caller's retry policy applies as for any other call.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import redis

WINDOW = 16
"""Commands sent before their replies are read (``call``)."""


def bulk(items_NL: np.ndarray) -> np.ndarray:
    """Return uint8 [N, *]: each row of ``items_NL`` (uint8, all of one length) as a RESP bulk
    string (``$L\\r\\n<row>\\r\\n``)."""
    n, length = items_NL.shape
    head = np.frombuffer(b"$%d\r\n" % length, dtype=np.uint8)
    buf = np.empty((n, head.shape[0] + length + 2), dtype=np.uint8)
    buf[:, : head.shape[0]] = head
    buf[:, head.shape[0] : head.shape[0] + length] = items_NL
    buf[:, -2:] = (13, 10)
    return buf


def bulks(*parts: bytes | str) -> bytes:
    """Return a few arguments as RESP bulk strings (str encoded as UTF-8)."""
    out = []
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def command(*parts: bytes | str) -> bytes:
    """Return one Redis command of a few arguments in RESP."""
    return b"*%d\r\n" % len(parts) + bulks(*parts)


def pack(command: bytes, names_NW: np.ndarray, values_NV: np.ndarray | None, per: int) -> list[bytes]:
    """Return the RESP of ``command`` over ``names_NW`` in commands of at most ``per`` keys
    (each key followed by its row of ``values_NV`` if given), one bytes object a command."""
    n = names_NW.shape[0]
    if values_NV is None:
        rec = bulk(names_NW)
    else:
        if values_NV.shape[0] != n:
            raise ValueError(f"{n} names but {values_NV.shape[0]} values")
        rec = np.hstack([bulk(names_NW), bulk(values_NV)])
    args_per_key = 1 if values_NV is None else 2
    commands = []
    for start in range(0, n, per):
        m = min(per, n - start)
        head = b"*%d\r\n$%d\r\n%s\r\n" % (1 + args_per_key * m, len(command), command)
        commands.append(head + rec[start : start + m].tobytes())
    return commands


@contextlib.contextmanager
def connection(client: redis.Redis):
    """Yield one of ``client``'s pooled connections, dropped on any error (replies may be left
    unread on it, or a WATCH or MULTI open: it must not reach its next user)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        yield conn
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def exchange(conn, commands: list[bytes], window: int | None = WINDOW, errors_as_values: bool = False) -> list:
    """Send packed commands on ``conn``, ``window`` at a time (None: all in one send), reading
    each window's replies before the next is sent; return the replies in order. A reply that
    is an error is raised (the rest left unread: drop ``conn``), or with ``errors_as_values``
    returned as the ``ResponseError`` it is, and the next reply read (for a transaction or a
    pipeline whose every reply the caller inspects)."""
    import redis

    window = window or max(1, len(commands))
    replies = []
    for start in range(0, len(commands), window):
        part = commands[start : start + window]
        conn.send_packed_command(part)
        for _ in part:
            try:
                replies.append(conn.read_response())
            except redis.exceptions.ResponseError as exc:
                if not errors_as_values:
                    raise
                replies.append(exc)
    return replies


def call(client: redis.Redis, commands: list[bytes], window: int | None = WINDOW,
         errors_as_values: bool = False) -> list:
    """Send packed commands on one pooled connection (``exchange``); return the replies in order.

    Windows, not all at once: a send must finish within the socket timeout, and neither side
    buffers more than a window's commands and replies (a checkpoint reads millions of rows
    in one call)."""
    if not commands:
        return []
    with connection(client) as conn:
        return exchange(conn, commands, window, errors_as_values)
