"""recsys: a training stack for recommendation models with huge sparse ID features.

Kept import-light on purpose: importing `recsys` (or `recsys.features.hashing`, `recsys.features.schema`,
`recsys.config`) must not import torch, because the lookup service shares the hashing.
"""

__version__ = "0.1.0"
