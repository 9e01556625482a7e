"""Redis URLs in messages and saved files: the one redaction of a password (no imports of the project).

``recsys.redisio.client`` (its "Secrets") says what each function promises and offers them with
the Redis helpers; they live here so that ``recsys.errors``, the lowest module, redacts the
one-line user errors without importing the Redis helpers (which raise its ``UserError``).

**Ambiguous URLs.** A URL parser ends the host part at the first ``/``, ``?`` or ``#``, so a
password holding one of them unencoded (``redis://:/Zx9@host``, ``redis://u:2024#Zx9@host``)
puts an ``@`` after the host part: the parser sees no password (and another host), and what
looked like a password sits in the path, query or fragment. Such a URL (``ambiguous``) is
masked whole from ``//`` up to its last ``@``, and entirely when an ``=`` there says the
``@`` may sit inside a query value; ``strip_password`` refuses it and ``check_url`` refuses it
with the fix (percent-encode, or a password file / ``$REDIS_PASSWORD``).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit

_MASK = "***"
_QUERY_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*")
_REDIS_URL = re.compile(r"(?:rediss?|unix)://")


def _secret_key(key: str) -> bool:
    return "password" in key.lower() or not _QUERY_KEY.fullmatch(key)


def ambiguous(url: str) -> bool:
    """Return whether ``url`` holds an ``@`` after its host part began to end (a ``/``, ``?`` or
    ``#`` after ``//``): a password with one of those unencoded, or an ``@`` in a path or query."""
    after = url.split("://", 1)[1] if "://" in url else url
    netloc = re.split(r"[/?#]", after, maxsplit=1)[0]
    return "@" in after[len(netloc):]


def _masked_whole(url: str) -> str:
    """The message form of an ``ambiguous`` URL: nothing from ``//`` up to its last ``@`` shown."""
    scheme, _, after = url.partition("://")
    hidden, _, rest = after.rpartition("@")
    shown = redact(f"{scheme}://{rest}")
    if "=" in hidden or not rest or "://" not in shown:  # the '@' may be inside a query value: what
        return f"{scheme}://{_MASK}"  # follows it may be the value's rest
    return f"{scheme}://{_MASK}@" + shown.partition("://")[2]


def _rewrite(url: str, mask: str | None) -> str:
    """Return ``url`` with every credential replaced by ``mask`` (None: removed); ValueError if
    unparsable or ``ambiguous``."""
    if ambiguous(url):
        raise ValueError("an '@' after a '/', '?' or '#': ambiguous")
    parts = urlsplit(url)
    parts.port  # noqa: B018 - raises ValueError for a bad port, as redis-py would
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    if parts.password is not None and mask is not None:
        user = f"{user}:{mask}"
    netloc = f"{user}@{host}" if user else host
    query = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if _secret_key(key):
            if mask is not None:
                query.append((key if _QUERY_KEY.fullmatch(key) else mask, mask))
        else:
            query.append((key, value))
    # redis-py ignores a fragment; after an unquoted '#' in a password it holds the password's rest
    fragment = mask if parts.fragment and mask is not None else ""
    query_text = urlencode(query, safe="/:*")
    # by hand, not urlunsplit: that drops the '//' of unix:///path
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query_text}" if query_text else "")
            + (f"#{fragment}" if fragment else ""))


def redact(url: str) -> str:
    """Return ``url`` for a message or a log line: every password replaced by ``***`` (an
    ``ambiguous`` one masked whole up to its last ``@``)."""
    if "://" not in url:  # not a URL (e.g. a scheme left out): what precedes an '@' may be a password
        return f"{_MASK}@{url.rpartition('@')[2]}" if "@" in url else url
    if ambiguous(url):
        return _masked_whole(url)
    try:
        return _rewrite(url, _MASK)
    except ValueError:
        return "<unparsable url>"


def redact_text(text: str) -> str:
    """Return ``text`` with every Redis URL in it redacted (``redact``), and every other URL
    holding an ``@`` (its user info may be a password)."""
    return _URL_IN_TEXT.sub(_redact_match, text)


def _redact_match(match: re.Match) -> str:
    url = match.group(0)  # another scheme's URL (a database's, a mistyped http://) only for its user info
    return redact(url) if _REDIS_URL.match(url) or "@" in url else url


def strip_password(url: str) -> str:
    """Return ``url`` as it may be saved: without any password (``ValueError`` if unparsable or
    ``ambiguous``: then nothing of it may be saved but what ``redact`` shows)."""
    return _rewrite(url, None)


def has_password(url: str) -> bool:
    """Return whether ``url`` carries a password itself (in its netloc or its query; an
    ``ambiguous`` one may: True)."""
    if ambiguous(url):
        return True
    try:
        return _rewrite(url, _MASK) != _rewrite(url, None)
    except ValueError:
        return False
