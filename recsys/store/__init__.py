"""The embedding store: key→slot maps, rows and optimizer state, LRU tiers, spill, sharding.

Import the modules themselves (``recsys.store.table``, ``recsys.store.keymap``, ...):
this package imports nothing heavy, so ``recsys.store.config`` stays cheap for the CLI.

- ``config``  ``StoreConfig``: optimizer, init, admission, storage dtype.
- ``keymap``  ``KeyMap`` (64-bit key → slot, exact LRU eviction) and ``FrequencySketch``.
- ``optim``   the sparse optimizers (row-wise Adagrad, Adagrad, Adam, SGD), numba kernels.
- ``table``   ``EmbeddingTable``: one shard's rows of one table, Arrow state in and out.
"""
