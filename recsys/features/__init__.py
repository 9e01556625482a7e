"""What a sparse or dense feature is, and how raw values become model inputs (no torch).

- ``schema``   ``Schema``: label, dense columns, sparse features and the tables they look up.
- ``hashing``  raw ids (ints, strings) → stable 64-bit keys; a key's owner rank.
- ``dense``    dense columns' streamed statistics and the transforms they drive.
"""
