"""The spill tier's Redis commands, packed as arrays (``recsys.store.spill.tier``).

Legend: ``N`` keys, ``W`` bytes of a Redis name, ``V`` bytes of a value, ``B`` keys per command.

Every name a tier sends has the same length (its prefix and 16 hex digits) and every value
too (one fixed-size record), so a run of ``MSET name value name value ...`` (or ``UNLINK`` /
``MGET name name ...``) commands is one fixed-stride array of bytes: the RESP framing of a key
(``$W\\r\\n<name>\\r\\n`` and ``$V\\r\\n<value>\\r\\n``) is filled for all N keys at once, and
each command adds a short header. redis-py packs a command argument by argument in Python
(the largest part of the writer thread's CPU in a profile of ``recsys bench scale``); this is
a few numpy copies.

``call`` sends the packed commands on one of the client's pooled connections, a window of
them at a time, and reads their replies in order (parsed by the connection's reader: hiredis
when installed). A connection that failed in between is dropped, not reused, so no reply is
ever read by the wrong call.
Errors are redis-py's (``ConnectionError``, ``TimeoutError``, ``ResponseError``): the tier's
retry policy applies as for any other call.
"""

from __future__ import annotations

import numpy as np
import redis

WINDOW = 16
"""Commands sent before their replies are read (``call``)."""


def pack(command: bytes, names_NW: np.ndarray, values_NV: np.ndarray | None, per: int) -> list[bytes]:
    """Return the RESP of ``command`` over ``names_NW`` in commands of at most ``per`` keys
    (each key followed by its row of ``values_NV`` if given), one bytes object a command."""
    n, w = names_NW.shape
    fields: list = [b"$%d\r\n" % w, names_NW, b"\r\n"]
    if values_NV is not None:
        if values_NV.shape[0] != n:
            raise ValueError(f"{n} names but {values_NV.shape[0]} values")
        fields += [b"$%d\r\n" % values_NV.shape[1], values_NV, b"\r\n"]
    widths = [len(f) if isinstance(f, bytes) else f.shape[1] for f in fields]
    rec = np.empty((n, sum(widths)), dtype=np.uint8)
    at = 0
    for f, width in zip(fields, widths):
        rec[:, at : at + width] = np.frombuffer(f, dtype=np.uint8) if isinstance(f, bytes) else f
        at += width
    args_per_key = 1 if values_NV is None else 2
    commands = []
    for start in range(0, n, per):
        m = min(per, n - start)
        head = b"*%d\r\n$%d\r\n%s\r\n" % (1 + args_per_key * m, len(command), command)
        commands.append(head + rec[start : start + m].tobytes())
    return commands


def call(client: redis.Redis, commands: list[bytes], window: int = WINDOW) -> list:
    """Send packed commands on one pooled connection, ``window`` at a time, reading each
    window's replies before the next is sent; return the replies in order.

    Windows, not all at once: a send must finish within the socket timeout, and neither side
    buffers more than a window's commands and replies (a checkpoint reads millions of rows
    in one call)."""
    if not commands:
        return []
    pool = client.connection_pool
    conn = pool.get_connection()
    replies = []
    try:
        for start in range(0, len(commands), window):
            part = commands[start : start + window]
            conn.send_packed_command(part)
            replies += [conn.read_response() for _ in part]
        return replies
    except BaseException:
        conn.disconnect()  # replies may be left unread on it: never reuse it
        raise
    finally:
        pool.release(conn)
