"""Small Redis helpers shared by the spill tier, ``recsys export``, live pushes and the lookup service.

No torch here.

**Secrets.** A Redis password never reaches a file, a log line or a message:

- ``redact(url)`` is the one redaction of a URL for messages and logs. It hides every
  credential form redis-py accepts: ``user:password@`` / ``:password@`` in the netloc,
  ``?password=`` (and any other query key naming a password, e.g. ``ssl_password``), and
  whatever a stray ``#`` or ``?`` inside an unquoted password split off. The user name
  stays (it is saved, as the resumed run needs it), but in an ``ambiguous`` URL (an ``@``
  after a ``/``, ``?`` or ``#``: an unencoded password holding one) nothing between ``//``
  and the last ``@`` is shown. ``check_url`` (every setting holding a URL) refuses such a
  URL, and one with a ``#``, whitespace or a quote, naming the fixes: percent-encode the
  password, or leave it out and give it in the ``*_password_file`` / ``$REDIS_PASSWORD``.
  ``redact_text`` applies it to every Redis URL inside a text (the one-line user
  errors go through it: ``recsys.errors.user_message``). Both live in ``recsys.redisio.redaction``
  (which ``recsys.errors``, below this module, imports).
- ``strip_password(url)`` is the URL as it may be saved (a run's ``config.toml``, every
  checkpoint's ``meta.json``): the same URL without its password.
- A URL without a password gets it from ``password_for``: the job's ``*_password_file``
  key (a file holding the password), else the ``REDIS_PASSWORD`` environment variable. A
  URL with its own password uses that one (for the connection only: it is never saved).
  ``connect`` and ``client_options`` apply this to every client.

A URL names either a single Redis or any node of a Redis Cluster; ``connect`` asks the
server which (``INFO cluster``) and returns the matching redis-py client.
"""

from __future__ import annotations

import os
import re

from recsys.errors import UserError
from recsys.redisio.redaction import ambiguous, has_password, redact, redact_text, strip_password

__all__ = ["redact", "ambiguous", "redact_text", "strip_password", "has_password", "password_for", "client_options",
           "glob_escape", "check_url", "connect", "is_cluster_info", "PASSWORD_ENV"]

URL_SCHEMES = ("redis://", "rediss://", "unix://")
PASSWORD_ENV = "REDIS_PASSWORD"
"""The environment variable a URL without a password takes it from (after a ``*_password_file``)."""


def password_for(url: str, password_file: str = "", where: str = "redis") -> str | None:
    """Return the password to send for ``url`` when it has none of its own: the contents of
    ``password_file`` (one line), else ``$REDIS_PASSWORD``; None when the URL has its own
    password or no source gives one. ``where`` names the setting in errors (``UserError``)."""
    if has_password(url):
        return None
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as fh:
                password = fh.read().strip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise UserError(f"{where}: cannot read the Redis password file {password_file}: {why}") from None
        if not password or "\n" in password:
            raise UserError(f"{where}: the Redis password file {password_file} must hold one non-empty line")
        return password
    return os.environ.get(PASSWORD_ENV) or None


def client_options(url: str, password_file: str = "", where: str = "redis") -> dict:
    """Return the extra redis-py keyword arguments for ``url``: its password, when it comes
    from ``password_file`` or the environment (``password_for``)."""
    password = password_for(url, password_file, where)
    return {} if password is None else {"password": password}


PASSWORD_SETTINGS = {"store.spill.url": "store.spill.password_file", "publish.redis": "publish.redis_password_file",
                     "redis": "redis_password_file", "--redis": "--redis-password-file"}
"""The setting that gives the password of each URL setting (by the ``where`` its checks name)."""


def glob_escape(text: str) -> str:
    """Return ``text`` with Redis glob metacharacters escaped (for SCAN MATCH)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def check_url(url: str, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``url`` is a Redis URL that every reader parses
    alike (the message shows it redacted): one whose password could end up elsewhere (in the
    host, the path or a fragment redis-py drops) is refused, naming the two fixes."""
    if not url.startswith(URL_SCHEMES):
        raise ValueError(f"{where}: expected a Redis URL starting with one of {list(URL_SCHEMES)}, "
                         f"found {redact(url)!r}")
    setting = next((key for prefix, key in PASSWORD_SETTINGS.items() if where.startswith(prefix)), "")
    fix = ("percent-encode the password (/ %2F, ? %3F, # %23, @ %40, space %20), or leave it out of the URL "
           f"and give it in {setting + ' (a file holding it)' if setting else 'a password file'} or ${PASSWORD_ENV}")
    if ambiguous(url):
        raise ValueError(f"{where}: ambiguous Redis URL {redact(url)!r}: an '@' after a '/', '?' or '#' (redis-py "
                         f"would read no password and another host or path); {fix}")
    bad = sorted({ch for ch in url if ch.isspace() or ch in "#'\"<>\\"})
    if bad:
        raise ValueError(f"{where}: Redis URL {redact(url)!r} holds {' '.join(map(repr, bad))} (redis-py drops what "
                         f"follows a '#', and messages could not quote it whole); {fix}")
    try:
        strip_password(url)
    except ValueError:  # redis-py could not parse it either; the parser's words may quote a password
        raise ValueError(f"{where}: not a valid Redis URL: {redact(url)!r} (expected a numeric port and a "
                         f"bracketed IPv6 address); if the password holds ':' or '[', {fix}") from None


def is_cluster_info(info: dict) -> bool:
    """Return whether an ``INFO cluster`` reply says cluster mode is enabled."""
    return str(info.get("cluster_enabled", 0)) == "1"


def connect(url: str, timeout_s: float = 5.0, password_file: str = "", where: str = "redis url", **kwargs):
    """Return a synchronous client for ``url``: ``redis.Redis`` or ``redis.cluster.RedisCluster``.

    The password is the URL's, else ``password_file``'s, else ``$REDIS_PASSWORD`` (``password_for``)."""
    import redis
    from redis.cluster import RedisCluster

    check_url(url, where)
    opts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                **client_options(url, password_file, where), **kwargs)
    probe = redis.Redis.from_url(url, **opts)
    try:
        cluster = not url.startswith("unix://") and is_cluster_info(probe.info("cluster"))
    finally:
        probe.close()
    if cluster:
        return RedisCluster.from_url(url, **opts)
    return redis.Redis.from_url(url, **opts)
