"""Checkpoints keyed by id, restorable at any world size.

- ``write``  ``save``: an atomic checkpoint and the ``latest`` pointer (torch).
- ``read``   finding a checkpoint from any path, its meta, dense state and rows (no torch).
"""
