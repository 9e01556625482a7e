"""Redis URLs in messages and saved files: the one redaction of a password (no imports of the project).

``recsys.redisio.client`` (its "Secrets") says what each function promises and offers them with
the Redis helpers; they live here so that ``recsys.errors``, the lowest module, redacts the
one-line user errors without importing the Redis helpers (which raise its ``UserError``).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit

_MASK = "***"
_QUERY_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_URL_IN_TEXT = re.compile(r"(?:rediss?|unix)://[^\s'\"<>]*")


def _secret_key(key: str) -> bool:
    return "password" in key.lower() or not _QUERY_KEY.fullmatch(key)


def _rewrite(url: str, mask: str | None) -> str:
    """Return ``url`` with every credential replaced by ``mask`` (None: removed); ValueError if unparsable."""
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
    """Return ``url`` for a message or a log line: every password replaced by ``***``."""
    try:
        return _rewrite(url, _MASK)
    except ValueError:
        return "<unparsable url>"


def redact_text(text: str) -> str:
    """Return ``text`` with every Redis URL in it redacted (``redact``)."""
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


def strip_password(url: str) -> str:
    """Return ``url`` as it may be saved: without any password (``ValueError`` if unparsable)."""
    return _rewrite(url, None)


def has_password(url: str) -> bool:
    """Return whether ``url`` carries a password itself (in its netloc or its query)."""
    try:
        return _rewrite(url, _MASK) != _rewrite(url, None)
    except ValueError:
        return False
