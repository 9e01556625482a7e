"""Errors caused by the user's input (job files, data, requests): shown without a traceback."""

from __future__ import annotations

import json

from recsys.redisio.redaction import redact_text


class UserError(ValueError):
    """Bad input: the message says where (file, column, row group, key) and what was expected."""


def user_message(exc: BaseException) -> str | None:
    """Return the one-line message of an error caused by the user's input, or None for a bug.

    Input errors: ``UserError`` (config errors, the reader's ``ReadError``...), an ``OSError``
    (a path that is missing, a directory, unreadable, a full disk...), a file that is not
    UTF-8 or not JSON. Anything else is a bug and keeps its traceback. Every Redis URL in the
    message is redacted (``recsys.redisio.redaction.redact_text``).
    """
    if isinstance(exc, UserError):
        text = str(exc)
    elif isinstance(exc, OSError):
        text = f"{exc.filename}: {exc.strerror or exc}" if exc.filename and exc.strerror else str(exc)
    elif isinstance(exc, UnicodeDecodeError):
        text = f"not UTF-8 text: {exc.reason} at byte {exc.start}"
    elif isinstance(exc, json.JSONDecodeError):
        text = f"invalid JSON: {exc}"
    else:
        return None
    # the last line of defence: a Redis URL quoted anywhere (an override, a path) loses its password
    return redact_text(" ".join(text.split())) or type(exc).__name__
