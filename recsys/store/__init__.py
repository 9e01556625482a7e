"""The embedding store: key→slot maps, rows and optimizer state, LRU tiers, spill, sharding.

Import the modules themselves: no ``__init__`` here imports anything, so
``recsys.store.config`` stays cheap for the CLI.

- ``config``     ``StoreConfig`` and its sections: the settings of every part below.
- ``protocols``  the contracts the trainer and ``recsys eval`` call on a store, a lookup, a table.
- ``tables``     one shard of one table: key map (exact LRU), rows, optimizer state, kernels.
- ``spill``      the spill tier: evicted rows kept in Redis, and its key index.
- ``device``     the device tiers: a table's hot rows (``DeviceCache``) or all of them (``DeviceTable``).
- ``sharded``    ``ShardedEmbeddingStore``: rows owned by rank, its schedule, exchange and lanes.
- ``host``       host-memory tricks the tables use: huge pages, kept heap, prefetch hints.
"""
