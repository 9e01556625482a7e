"""The sharded store: every table's rows owned by one rank, looked up batch-locally.

- ``store``     ``ShardedEmbeddingStore``: lookups, pushes with bounded staleness, state in and out.
- ``schedule``  the store's op sequence on its worker thread, and the staleness gate.
- ``exchange``  the all-to-alls between ranks: keys to owners, rows back, gradients to owners.
- ``lookup``    ``Lookup``: one batch's rows, what the trainer pools and pushes.
- ``lanes``     a call's per-table work spread over threads.
"""
