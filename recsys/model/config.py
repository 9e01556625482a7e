"""Settings of the dense model (no torch here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

WIDE_SETTINGS = ("wide_lr", "wide_initial_accumulator", "wide_weight_decay")
"""The model settings that configure the wide arm (only with ``wide = true``)."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which dense model sits on top of the pooled embeddings, and its sizes."""

    arch: Literal["dlrm", "dcn", "deepfm"] = "dlrm"
    """``dlrm``: pairwise dot interaction; ``dcn``: DCN-v2 low-rank cross layers; ``deepfm``:
    a factorization machine's second-order term over the feature vectors plus a deep tower
    (the top MLP) over their concatenation (the dense columns: ``deepfm_dense``; the
    first-order term of the ids: ``wide``)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 32, 16])
    """Bottom (dense) MLP layer sizes; the last must equal the embedding dim."""
    top_mlp: list[int] = field(default_factory=lambda: [128, 64, 1])
    """Top MLP layer sizes; the last must be 1 (one logit)."""
    wide: bool = False
    """Add a wide arm to any arch: a learned scalar weight per id of every sparse feature,
    summed into the logit (logistic regression's per-id weights). The weights are rows of
    dim-1 tables ``<table>.wide`` in the embedding store (``recsys.store.tables.wide``): unbounded,
    sharded and checkpointed like the embeddings, starting at 0."""
    wide_lr: float | None = None
    """Learning rate of the wide arm's weights (unset: ``store.lr``). Its rows are scalars whose
    gradients are far larger than an embedding row's (the logit's own), so with row-wise
    Adagrad they may want other settings than the embeddings."""
    wide_initial_accumulator: float | None = None
    """Starting squared-gradient sum of a new wide weight (unset: ``store.initial_accumulator``).
    With row-wise Adagrad a weight's first step is ``lr·g/sqrt(acc0 + g²)``: ``acc0 = 0`` moves
    an id seen once by a full ``lr``, a larger ``acc0`` damps the steps of rare ids (whose few
    labels are mostly noise) and hardly changes those of frequent ones."""
    wide_weight_decay: float | None = None
    """L2 penalty of the wide weights (unset: ``store.weight_decay``)."""
    deepfm_dense: Literal["raw", "vector"] = "raw"
    """How ``deepfm`` takes the plain dense columns (not embedded by ``schema.dense_transform``).
    ``raw``: DeepFM as its paper builds it: the FM term is over the fields' vectors (sparse
    features and embedded dense columns), the deep tower (the top MLP) takes their
    concatenation and the plain dense values as they are, and the values add a linear term
    to the logit; no bottom MLP. ``vector``: the bottom MLP makes one more vector of them,
    which joins the FM term and the deep tower (recsys' former DeepFM: its checkpoints
    need this)."""
    dropout: float = 0.0
    """Dropout rate after each hidden layer of the dense towers in training: the bottom MLP's
    layers but its last (the interaction's dense vector) and the top MLP's layers but its
    last (the logit). 0: none."""
    heads: int = 1
    """Heads of the top MLP (the deep tower): K > 1 makes it a parameter-efficient ensemble
    of K heads over the shared embeddings and interaction, BatchEnsemble style (TabM,
    Gorishniy et al. 2025; ``recsys.model.heads``): one weight matrix a layer shared by the
    heads, each head its own input and output scalings (rank-1 adapters) and biases. Each
    head is trained on its own loss (the loss is their mean); a prediction is the mean of
    the K heads' probabilities. The embeddings are unchanged (export and serving too); the
    top MLP's compute is K times one head's (docs/dense_and_arms.md). 1: one plain MLP."""
    periodic_frequencies: int = 16
    """Frequencies per column of a ``periodic`` dense column (``schema.dense_transform``):
    its vector is ReLU(Linear([sin(2π c x), cos(2π c x)])) with ``c`` learned, so 2 × this
    many features go into the linear map (Gorishniy et al. 2022, PLR)."""
    periodic_sigma: float = 1.0
    """Standard deviation of the initial frequencies ``c ~ N(0, σ²)`` of ``periodic`` columns
    (over standardized values: small σ, smooth functions; the paper's most sensitive setting,
    tuned per data set there; the default's figures: docs/dense_and_arms.md)."""
    dcn_layers: int = 3
    """Cross layers (``dcn`` only)."""
    dcn_low_rank: int = 64
    """Rank of each cross layer's weight (``dcn`` only)."""

    def __post_init__(self) -> None:
        if not self.bottom_mlp or min(self.bottom_mlp) <= 0:
            raise ValueError(f"bottom_mlp must be non-empty positive sizes, found {self.bottom_mlp}")
        if len(self.top_mlp) < 2 or min(self.top_mlp) <= 0 or self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp needs >= 2 positive sizes ending in 1, found {self.top_mlp}")
        if not (math.isfinite(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout must be in [0, 1), found {self.dropout}")
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise ValueError(f"heads must be an integer >= 1 (1: one top MLP), found {self.heads!r}")
        if self.periodic_frequencies < 1:
            raise ValueError(f"periodic_frequencies must be >= 1, found {self.periodic_frequencies}")
        if not (math.isfinite(self.periodic_sigma) and self.periodic_sigma > 0):
            raise ValueError(f"periodic_sigma must be a finite number > 0, found {self.periodic_sigma}")
        if self.dcn_layers < 1 or self.dcn_low_rank < 1:
            raise ValueError("dcn_layers and dcn_low_rank must be >= 1")
        if self.wide_lr is not None and not (math.isfinite(self.wide_lr) and self.wide_lr > 0):
            raise ValueError(f"wide_lr must be a finite number > 0 (or unset: store.lr), found {self.wide_lr}")
        for name in ("wide_initial_accumulator", "wide_weight_decay"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (or unset: the store's), found {value}")
        if not self.wide and any(getattr(self, n) is not None for n in WIDE_SETTINGS):
            raise ValueError(f"{' / '.join(WIDE_SETTINGS)} need model.wide = true")


def saved_model_settings(data: dict) -> dict:
    """Return a saved job's settings (a checkpoint's ``config``, as a dict) with the model
    settings its recsys had implied: a ``deepfm`` saved before ``deepfm_dense`` existed is
    the bottom-MLP form, ``"vector"``. Changes ``data`` in place."""
    model = data.get("model")
    if isinstance(model, dict) and model.get("arch") == "deepfm" and "deepfm_dense" not in model:
        model["deepfm_dense"] = "vector"
    return data
