"""The spill tier: rows evicted from a table kept in Redis, read back on the next miss.

- ``tier``   ``SpillTier``, ``SpillError``; ``find_leftovers`` / ``clear_tables`` of a namespace.
- ``index``  ``KeyIndex``: the set of keys a tier holds in Redis.

The keys and values it writes are laid out in ``recsys.redisio.spill_layout``.
"""
