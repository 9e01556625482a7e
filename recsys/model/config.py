"""Settings of the dense model (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which dense model sits on top of the pooled embeddings, and its sizes."""

    arch: Literal["dlrm", "dcn", "deepfm"] = "dlrm"
    """``dlrm``: pairwise dot interaction; ``dcn``: DCN-v2 low-rank cross layers; ``deepfm``:
    a factorization machine's second-order term over the feature vectors plus a deep tower
    (the top MLP) over their concatenation."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 32, 16])
    """Bottom (dense) MLP layer sizes; the last must equal the embedding dim."""
    top_mlp: list[int] = field(default_factory=lambda: [128, 64, 1])
    """Top MLP layer sizes; the last must be 1 (one logit)."""
    wide: bool = False
    """Add a wide arm to any arch: a learned scalar weight per id of every sparse feature,
    summed into the logit (logistic regression's per-id weights). The weights are rows of
    dim-1 tables ``<table>.wide`` in the embedding store (``recsys.store.wide``): unbounded,
    sharded and checkpointed like the embeddings, starting at 0."""
    dcn_layers: int = 3
    """Cross layers (``dcn`` only)."""
    dcn_low_rank: int = 64
    """Rank of each cross layer's weight (``dcn`` only)."""

    def __post_init__(self) -> None:
        if not self.bottom_mlp or min(self.bottom_mlp) <= 0:
            raise ValueError(f"bottom_mlp must be non-empty positive sizes, found {self.bottom_mlp}")
        if len(self.top_mlp) < 2 or min(self.top_mlp) <= 0 or self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp needs >= 2 positive sizes ending in 1, found {self.top_mlp}")
        if self.dcn_layers < 1 or self.dcn_low_rank < 1:
            raise ValueError("dcn_layers and dcn_low_rank must be >= 1")
