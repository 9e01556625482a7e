"""Settings of the lookup service, from ``recsys serve`` flags or ``RECSYS_SERVE_*`` variables.

Each field has an environment variable: ``RECSYS_SERVE_`` + the field name in capitals
(``RECSYS_SERVE_REDIS``, ``RECSYS_SERVE_MAX_IDS``...). Worker processes (``--workers N``)
are given their settings that way. The bearer token itself is never in a setting, a log
or the environment: only the path of the file holding it. Give a Redis password the same
way (``redis_password_file``, or ``$REDIS_PASSWORD``): one written in the ``redis`` URL
reaches the workers in ``RECSYS_SERVE_REDIS``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import typing
from dataclasses import dataclass

from recsys.redisio import published as layout
from recsys.redisio.client import check_url

ENV_PREFIX = "RECSYS_SERVE_"


def is_loopback(host: str) -> bool:
    """Return whether binding ``host`` keeps the service on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(kw_only=True, slots=True)
class ServeSettings:
    """What the service serves and how it guards itself."""

    checkpoint: str = ""
    """Serve this checkpoint from memory (the embedded default); any path form ``recsys eval`` takes."""
    redis: str = ""
    """Serve the versions published to this Redis (or Redis Cluster) URL; ``rediss://`` for TLS."""
    redis_password_file: str = ""
    """File holding the Redis password, for a ``redis`` URL without one (else ``$REDIS_PASSWORD``)."""
    namespace: str = "recsys"
    """Namespace the versions were published under (``recsys export --namespace``)."""
    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = 8000
    """Port to bind."""
    workers: int = 1
    """Worker processes (each holds its own cache, and in embedded mode its own rows)."""
    token_file: str = ""
    """File holding a bearer token; when set, /v1/* and /metrics require ``Authorization: Bearer``
    and /readyz tells its details (paths, URLs) only to a caller that sends it. Off loopback
    (``host`` not 127.x, ::1 or localhost) a token needs ``ssl_certfile``: it never travels in clear."""
    ssl_certfile: str = ""
    """Serve HTTPS with this certificate (PEM; uvicorn's ``ssl_certfile``); needs ``ssl_keyfile``."""
    ssl_keyfile: str = ""
    """The certificate's private key (PEM)."""
    max_ids: int = 10_000
    """Most ids one request may ask for (all lookups of a batch together); more: 413."""
    max_lookups: int = 1_000
    """Most lookups one ``POST /v1/lookup/batch`` may hold (each costs a resolution and a
    backend read even with no ids); more: 413."""
    max_body_bytes: int = 4 << 20
    """Largest request body accepted; larger: 413."""
    fast_path: bool = True
    """Answer the lookups that end in 200 without the framework's per-request stack
    (``embedding_server.fastpath``); False: every request through the app (to compare)."""
    cache_bytes: int = 256 << 20
    """Bytes of the in-process LRU cache of rows read from Redis, per worker (0: none)."""
    refresh_s: float = 1.0
    """How often the Redis alias is read: a published version is served within this interval."""
    redis_timeout_s: float = 2.0
    """Seconds a Redis call may wait for its reply; past it the request gets 503."""
    follow: str = ""
    """Live namespace whose rows (pushed by a training job) are overlaid on the served version
    (``recsys serve --follow``; empty: published rows only). Needs ``redis``."""
    live_ttl_s: float = 1.0
    """Seconds a worker caches a live row (or its absence) before reading it again; 0: no cache.
    A served live row is at most the trainer's push interval plus this old."""

    def __post_init__(self) -> None:
        if bool(self.checkpoint) == bool(self.redis):
            raise ValueError("give exactly one of checkpoint (the embedded default) or redis (a URL)")
        if self.redis:
            check_url(self.redis, "redis")
        layout.check_name(self.namespace, "namespace")
        if self.follow:
            if not self.redis:
                raise ValueError("follow needs redis: live rows are read from the Redis that holds the published "
                                 "versions")
            layout.check_name(self.follow, "follow")
        if not (math.isfinite(self.live_ttl_s) and self.live_ttl_s >= 0):
            raise ValueError(f"live_ttl_s must be >= 0 (0: no live row cache), found {self.live_ttl_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], found {self.port}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, found {self.workers}")
        if self.max_ids < 1:
            raise ValueError(f"max_ids must be >= 1, found {self.max_ids}")
        if self.max_lookups < 1:
            raise ValueError(f"max_lookups must be >= 1, found {self.max_lookups}")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("ssl_certfile and ssl_keyfile go together (--ssl-certfile, --ssl-keyfile): give both "
                             "for HTTPS, or neither")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name} {path}: not a file (expected a PEM file)")
        if self.token_file and not self.ssl_certfile and not is_loopback(self.host):
            raise ValueError(f"token_file with host {self.host!r} (not loopback) needs ssl_certfile and ssl_keyfile "
                             "(--ssl-certfile, --ssl-keyfile): the bearer token must not travel in clear")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, found {self.max_body_bytes}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0 (0: no cache), found {self.cache_bytes}")
        if not self.refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, found {self.refresh_s}")
        if not self.redis_timeout_s > 0:
            raise ValueError(f"redis_timeout_s must be > 0, found {self.redis_timeout_s}")

    @property
    def scheme(self) -> str:
        """``https`` with a certificate, else ``http``."""
        return "https" if self.ssl_certfile else "http"

    def token(self) -> str | None:
        """Return the bearer token from ``token_file`` (None when unset); ``ValueError`` if empty."""
        if not self.token_file:
            return None
        with open(self.token_file, encoding="utf-8") as fh:
            token = fh.read().strip()
        if not token or any(ch.isspace() for ch in token):
            raise ValueError(f"token file {self.token_file}: expected one token without whitespace")
        return token

    def to_env(self) -> dict[str, str]:
        """Return the ``RECSYS_SERVE_*`` variables that rebuild these settings."""
        return {ENV_PREFIX + f.name.upper(): str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_env(cls, environ: typing.Mapping[str, str] | None = None) -> "ServeSettings":
        """Return settings from ``RECSYS_SERVE_*`` variables (defaults for the others)."""
        environ = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            kind = hints[f.name]
            if kind is bool:
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: expected true or false")
                values[f.name] = raw.lower() in ("true", "1")
                continue
            try:
                values[f.name] = kind(raw) if kind in (int, float) else raw
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: expected {kind.__name__}") from None
        return cls(**values)
