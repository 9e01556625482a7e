"""Settings of the lookup service, from ``recsys serve`` flags or ``RECSYS_SERVE_*`` variables.

Each field has an environment variable: ``RECSYS_SERVE_`` + the field name in capitals
(``RECSYS_SERVE_REDIS``, ``RECSYS_SERVE_MAX_IDS``...). Worker processes (``--workers N``)
are given their settings that way. The bearer token itself is never in a setting, a log
or the environment: only the path of the file holding it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass

from embedding_server import layout
from recsys.redis_util import check_url

ENV_PREFIX = "RECSYS_SERVE_"


@dataclass(kw_only=True, slots=True)
class ServeSettings:
    """What the service serves and how it guards itself."""

    checkpoint: str = ""
    """Serve this checkpoint from memory (the embedded default); any path form ``recsys eval`` takes."""
    redis: str = ""
    """Serve the versions published to this Redis (or Redis Cluster) URL; ``rediss://`` for TLS."""
    namespace: str = "recsys"
    """Namespace the versions were published under (``recsys export --namespace``)."""
    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = 8000
    """Port to bind."""
    workers: int = 1
    """Worker processes (each holds its own cache, and in embedded mode its own rows)."""
    token_file: str = ""
    """File holding a bearer token; when set, /v1/* and /metrics require ``Authorization: Bearer``."""
    max_ids: int = 10_000
    """Most ids one request may ask for (all lookups of a batch together); more: 413."""
    max_body_bytes: int = 4 << 20
    """Largest request body accepted; larger: 413."""
    cache_bytes: int = 256 << 20
    """Bytes of the in-process LRU cache of rows read from Redis, per worker (0: none)."""
    refresh_s: float = 1.0
    """How often the Redis alias is read: a published version is served within this interval."""
    redis_timeout_s: float = 2.0
    """Socket timeout of one Redis call; past it the request gets 503."""
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
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, found {self.max_body_bytes}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0 (0: no cache), found {self.cache_bytes}")
        if not self.refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, found {self.refresh_s}")
        if not self.redis_timeout_s > 0:
            raise ValueError(f"redis_timeout_s must be > 0, found {self.redis_timeout_s}")

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
            try:
                values[f.name] = kind(raw) if kind in (int, float) else raw
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: expected {kind.__name__}") from None
        return cls(**values)
