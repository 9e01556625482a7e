"""Small Redis helpers shared by the spill tier, ``recsys export`` and the lookup service.

No torch here. A URL's password never reaches a log or an error message: use ``redact``.
A URL names either a single Redis or any node of a Redis Cluster; ``connect`` asks the
server which (``INFO cluster``) and returns the matching redis-py client.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

__all__ = ["redact", "glob_escape", "connect", "is_cluster_info"]

URL_SCHEMES = ("redis://", "rediss://", "unix://")


def redact(url: str) -> str:
    """Return ``url`` without its password."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def glob_escape(text: str) -> str:
    """Return ``text`` with Redis glob metacharacters escaped (for SCAN MATCH)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def check_url(url: str, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``url`` is a Redis URL."""
    if not url.startswith(URL_SCHEMES):
        raise ValueError(f"{where}: expected a Redis URL starting with one of {list(URL_SCHEMES)}, "
                         f"found {redact(url)!r}")


def is_cluster_info(info: dict) -> bool:
    """Return whether an ``INFO cluster`` reply says cluster mode is enabled."""
    return str(info.get("cluster_enabled", 0)) == "1"


def connect(url: str, timeout_s: float = 5.0, **kwargs):
    """Return a synchronous client for ``url``: ``redis.Redis`` or ``redis.cluster.RedisCluster``."""
    import redis
    from redis.cluster import RedisCluster

    check_url(url, "redis url")
    opts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **kwargs)
    probe = redis.Redis.from_url(url, **opts)
    try:
        cluster = not url.startswith("unix://") and is_cluster_info(probe.info("cluster"))
    finally:
        probe.close()
    if cluster:
        return RedisCluster.from_url(url, **opts)
    return redis.Redis.from_url(url, **opts)
