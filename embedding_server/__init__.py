"""The online embedding lookup service and ``recsys export`` (no torch here).

- ``app``       the ASGI app (``create_app``), its routes, limits and auth; ``serve`` runs it
- ``settings``  ``ServeSettings`` from flags or ``RECSYS_SERVE_*`` variables
- ``backends``  where rows come from: a checkpoint in memory, or published versions in Redis
- ``catalog``   a version's tables and features; raw ids → keys; the unseen-key vector
- ``cache``     the row cache (the store's key map, exact LRU, bytes-bounded)
- ``publish``   ``recsys export``: write, verify, flip the alias, keep K, gc
- ``resp``      a lean MGET client for a single Redis
- ``wire``      the binary response format
- ``metrics``   Prometheus metrics

What lies in Redis (the protocol the trainer and ``recsys export`` write and this package
reads): ``recsys.redisio.published`` (published versions) and ``recsys.redisio.live`` (live rows).
The design: docs/serving.md.
"""
