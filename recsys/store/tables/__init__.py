"""One shard of one embedding table, and the kernels it runs.

- ``table``     ``EmbeddingTable``: rows, optimizer state and LRU bookkeeping; Arrow state in and out.
- ``keymap``    ``KeyMap`` (64-bit key → slot, exact LRU eviction) and ``FrequencySketch`` (admission).
- ``dedup``     unique keys of a batch with their inverse.
- ``optim``     the sparse optimizers (row-wise Adagrad, Adagrad, Adam, SGD).
- ``initial``   a new key's initial vector, a pure function of (seed, table, key).
- ``float16``   float16 row storage conversions.
- ``rowblock``  ``RowBlock``: rows outside a table, and the Arrow columns of a table's state.
- ``pooling``   pooling of batch-local rows (single-hot gathers, multi-hot bag sums).
- ``fused``     ``TableGroup``: one kernel call per phase for all of a store's plain tables.
- ``wide``      the wide arm's dim-1 tables (``WideStore``).
"""
