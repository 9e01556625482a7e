"""DLRM, DCN-v2 and DeepFM dense models built from torchrec's arches, fed pooled embeddings.

Legend: ``B`` batch, ``N`` dense columns (``P`` of them plain numbers, ``E`` embedded:
quantile buckets or numeric embeddings, ``recsys.dense``), ``F`` sparse features, ``D``
embedding dim, ``K = F + E``.

    plain dense [B, P] ──► bottom MLP ──► [B, D] ─┐
    embedded dense [B, E] ──► vectors [B, E, D] ──┤
                                                   ├─► interaction ──► top MLP ──► logit [B]
    pooled embeddings [B, F, D] ───────────────────┘
       dlrm:   [dense, pairwise dots of the K+1 vectors]   (torchrec InteractionArch, faster gather)
       dcn:    low-rank cross layers over the K·D+D concat (torchrec InteractionDCNArch)
       deepfm: top MLP over the K·D+D concat, plus the FM term ½ Σ_d((Σ_k v_kd)² − Σ_k v_kd²)
    wide (model.wide, any arch): + Σ_f (pooled scalar weights of feature f's ids)   [B, F, 1]
                                 + Σ_e (embedded dense column e's scalar: per bucket, or
                                   linear in its piecewise-linear encoding)

An embedded column holds a bucket id (its row of a table of N_b + 1 rows, the last for
nulls) or a position p in [0, N_b] (the piecewise-linear encoding clamp(p − k, 0, 1),
k < N_b, projected to D; p < 0, a null, takes a learned vector of its own).

Model code never knows where embedding rows live: it takes pooled tensors.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, InteractionDCNArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet

from recsys.model.config import ModelConfig


class DotInteraction(InteractionArch):
    """torchrec's DLRM interaction, with the upper-triangle gather as one ``index_select``.

    Same output as ``InteractionArch`` (tested); its advanced-index gather and the
    ``index_put`` in its backward cost ~13.7 ms per step at B = 4096, F = 28 on CPU,
    against ~3.9 ms for a flat ``index_select``.
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__(num_sparse_features)
        n = num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("flat_triu", rows * n + cols, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        inter = torch.bmm(combined, combined.transpose(1, 2))
        return torch.cat((dense_features, inter.flatten(1).index_select(1, self.flat_triu)), dim=1)


def fm_second_order(v_BKD: torch.Tensor) -> torch.Tensor:
    """Return [B]: the sum over pairs k < l of <v_k, v_l>, as ½ Σ_d((Σ_k v)² − Σ_k v²) (O(K·D))."""
    s = v_BKD.sum(dim=1)
    return 0.5 * (s * s - (v_BKD * v_BKD).sum(dim=1)).sum(dim=1)


class FMInteraction(nn.Module):
    """DeepFM's interaction: the concatenated vectors (the deep tower's input) and the FM term."""

    def forward(self, dense_BD: torch.Tensor, sparse_BKD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = torch.cat((dense_BD.unsqueeze(1), sparse_BKD), dim=1)
        return v.flatten(1), fm_second_order(v)


class DenseEmbeddings(nn.Module):
    """The vectors of the embedded dense columns: [B, E] values → [B, E, D].

    With ``wide``, also their first-order term [B]: a learned scalar per bucket (and for the
    null bucket), or a linear map of the piecewise-linear encoding (and a null scalar): the
    per-value effect logistic regression on one-hot buckets learns, for dense columns.
    """

    def __init__(self, kinds: list[str], buckets: int, dim: int, wide: bool = False) -> None:
        super().__init__()
        self.buckets = buckets
        self.kinds = list(kinds)
        self.wide = wide
        bound = 1.0 / math.sqrt(dim)  # the store's default initial scale for sparse rows
        self.tables = nn.ModuleList()
        self.projections = nn.ModuleList()
        self.null_vectors = nn.ParameterList()
        for kind in kinds:
            if kind == "quantile_buckets":
                table = nn.Embedding(buckets + 1, dim)
                nn.init.uniform_(table.weight, -bound, bound)
                self.tables.append(table)
            else:
                self.projections.append(nn.Linear(buckets, dim))
                self.null_vectors.append(nn.Parameter(torch.empty(dim).uniform_(-bound, bound)))
        if wide:  # created after the vectors' parameters: a job without the wide arm keeps its init
            self.wide_tables = nn.ModuleList()
            self.wide_projections = nn.ModuleList()
            self.wide_nulls = nn.ParameterList()
            for kind in kinds:
                if kind == "quantile_buckets":
                    table = nn.Embedding(buckets + 1, 1)
                    nn.init.zeros_(table.weight)
                    self.wide_tables.append(table)
                else:
                    proj = nn.Linear(buckets, 1, bias=False)
                    nn.init.zeros_(proj.weight)
                    self.wide_projections.append(proj)
                    self.wide_nulls.append(nn.Parameter(torch.zeros(1)))
        self.register_buffer("steps", torch.arange(buckets, dtype=torch.float32), persistent=False)

    def forward(self, values_BE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (vectors [B, E, D], first-order term [B] with ``wide``, else None)."""
        out, first, t, p = [], [], 0, 0
        for e, kind in enumerate(self.kinds):
            x = values_BE[:, e]
            if kind == "quantile_buckets":
                ids = x.long()
                out.append(self.tables[t](ids))
                if self.wide:
                    first.append(self.wide_tables[t](ids).squeeze(1))
                t += 1
            else:
                null = x < 0
                encoded = (x.unsqueeze(1) - self.steps).clamp(0.0, 1.0)
                vec = self.projections[p](encoded)
                out.append(torch.where(null.unsqueeze(1), self.null_vectors[p], vec))
                if self.wide:
                    lin = self.wide_projections[p](encoded).squeeze(1)
                    first.append(torch.where(null, self.wide_nulls[p], lin))
                p += 1
        return torch.stack(out, dim=1), (torch.stack(first, dim=1).sum(dim=1) if self.wide else None)


class RankingModel(nn.Module):
    """Return click logits [B] from dense features [B, N] and pooled embeddings [B, F, D].

    ``dense_kinds``: each dense column's transform (``schema.dense_transform``; default: all
    plain numbers); ``buckets``: ``schema.dense_buckets``.
    """

    def __init__(self, cfg: ModelConfig, num_dense: int, num_sparse: int, dim: int,
                 dense_kinds: list[str] | None = None, buckets: int = 16) -> None:
        super().__init__()
        if cfg.bottom_mlp[-1] != dim:
            raise ValueError(
                f"model.bottom_mlp must end in the embedding dim {dim} (dense and sparse "
                f"vectors meet in one interaction), found {cfg.bottom_mlp}"
            )
        if num_dense <= 0:
            raise ValueError("the model needs at least one dense column")
        from recsys.dense import EMBEDDED

        kinds = list(dense_kinds) if dense_kinds is not None else ["signed_log1p"] * num_dense
        if len(kinds) != num_dense:
            raise ValueError(f"dense_kinds has {len(kinds)} entries for {num_dense} dense columns")
        plain = [j for j, k in enumerate(kinds) if k not in EMBEDDED]
        embedded = [j for j, k in enumerate(kinds) if k in EMBEDDED]
        self.split = bool(embedded)
        if self.split:
            self.register_buffer("plain_idx", torch.tensor(plain, dtype=torch.long), persistent=False)
            self.register_buffer("embedded_idx", torch.tensor(embedded, dtype=torch.long), persistent=False)
            self.dense_embeddings = DenseEmbeddings([kinds[j] for j in embedded], buckets, dim, wide=cfg.wide)
        # with every column embedded the bottom MLP still gives the interaction its dense
        # vector, from a constant input (a learned bias)
        self.dense_arch = DenseArch(max(1, len(plain)), cfg.bottom_mlp)
        K = num_sparse + len(embedded)
        self.arch = cfg.arch
        self.wide = cfg.wide
        if cfg.arch == "dlrm":
            self.interaction = DotInteraction(K)
            inter_out = dim + K + K * (K - 1) // 2
        elif cfg.arch == "dcn":
            width = (K + 1) * dim
            cross = LowRankCrossNet(width, num_layers=cfg.dcn_layers, low_rank=cfg.dcn_low_rank)
            self.interaction = InteractionDCNArch(num_sparse_features=K, crossnet=cross)
            inter_out = width
        else:
            self.interaction = FMInteraction()
            inter_out = (K + 1) * dim
        self.over_arch = OverArch(inter_out, cfg.top_mlp)

    def forward(self, dense_BN: torch.Tensor, pooled_BFD: torch.Tensor,
                wide_BF1: torch.Tensor | None = None) -> torch.Tensor:
        """``wide_BF1``: the wide arm's pooled weights (required with ``model.wide``)."""
        if self.wide != (wide_BF1 is not None):
            raise ValueError(f"model.wide = {str(self.wide).lower()}: the wide weights must be given "
                             f"{'' if self.wide else 'only '}with the wide arm, found "
                             f"{'none' if wide_BF1 is None else 'some'}")
        logit, first = self._deep(dense_BN, pooled_BFD)
        if wide_BF1 is None:
            return logit
        logit = logit + wide_BF1.sum(dim=(1, 2))
        return logit if first is None else logit + first

    def _deep(self, dense_BN: torch.Tensor, pooled_BFD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (the arch's logit [B], the embedded dense columns' first-order term [B] or None)."""
        first = None
        if self.split:
            plain = dense_BN.index_select(1, self.plain_idx)
            if plain.shape[1] == 0:
                plain = dense_BN.new_ones(dense_BN.shape[0], 1)
            vectors, first = self.dense_embeddings(dense_BN.index_select(1, self.embedded_idx))
            pooled_BFD = torch.cat((pooled_BFD, vectors), dim=1)
            dense_BN = plain
        dense_BD = self.dense_arch(dense_BN)
        if self.arch == "deepfm":
            flat, fm = self.interaction(dense_BD, pooled_BFD)
            return self.over_arch(flat).squeeze(-1) + fm, first
        inter = self.interaction(dense_BD, pooled_BFD)
        return self.over_arch(inter).squeeze(-1), first


def model_for(job) -> RankingModel:
    """Return the dense model of ``job`` (its schema's dense transforms and table dim)."""
    schema = job.schema
    dims = {t.dim for t in schema.tables.values()}
    if len(dims) != 1:
        raise ValueError(f"all tables need one dim for the interaction, found {sorted(dims)}")
    kinds = [schema.transform_of(c) for c in schema.dense]
    return RankingModel(job.model, len(schema.dense), len(schema.sparse), dims.pop(), kinds, schema.dense_buckets)


def model_inputs(lookup, num_features: int) -> tuple:
    """Return the sparse inputs of the model from a store lookup: (pooled,) or, with the
    wide arm's store (``recsys.store.wide.PairLookup``), (pooled, wide weights)."""
    wide = getattr(lookup, "wide_pooled", None)
    pooled = lookup.pooled(num_features)
    return (pooled,) if wide is None else (pooled, wide(num_features))
