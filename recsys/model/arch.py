"""DLRM, DCN-v2 and DeepFM dense models built from torchrec's arches, fed pooled embeddings.

Legend: ``B`` batch, ``N`` dense columns (``P`` of them plain numbers, ``E`` embedded:
quantile buckets, numeric or periodic embeddings, ``recsys.features.dense``), ``F`` sparse features,
``D`` embedding dim, ``K = F + E``.

    plain dense [B, P] ──► bottom MLP ──► [B, D] ─┐
    embedded dense [B, E] ──► vectors [B, E, D] ──┤
                                                   ├─► interaction ──► top MLP ──► logit [B]
    pooled embeddings [B, F, D] ───────────────────┘
       dlrm:   [dense, pairwise dots of the K+1 vectors]   (torchrec InteractionArch, faster gather)
       dcn:    low-rank cross layers over the K·D+D concat (torchrec InteractionDCNArch)
       deepfm (model.deepfm_dense = "raw", the paper's): no bottom MLP;
               top MLP over [the K·D concat, plain dense [B, P]] + the FM term over the K
               vectors ½ Σ_d((Σ_k v_kd)² − Σ_k v_kd²) + a linear term of plain dense
       deepfm (model.deepfm_dense = "vector"): top MLP over the K·D+D concat, plus the FM
               term over the K+1 vectors (the bottom MLP's one of them)
    heads (model.heads = K > 1, any arch): the top MLP as K BatchEnsemble heads
            (recsys.model.heads), each with the shared terms added (FM, wide); in training
            the K logits [B, K], each head trained on its own loss; in evaluation the
            logit of the mean of the K heads' probabilities [B]
    wide (model.wide, any arch): + Σ_f (pooled scalar weights of feature f's ids)   [B, F, 1]
                                 + Σ_e (embedded dense column e's scalar: per bucket, or
                                   linear in its piecewise-linear encoding)

An embedded column holds a bucket id (its row of a table of N_b + 1 rows, the last for
nulls), a position p in [0, N_b] (the piecewise-linear encoding clamp(p − k, 0, 1),
k < N_b, projected to D; p < 0, a null, takes a learned vector of its own), or a
standardized value z (periodic, PLR: ReLU(Linear_e([sin(2π c_e z), cos(2π c_e z)])), c_e
learned frequencies of its own; Gorishniy et al., "On Embeddings for Numerical Features in
Tabular Deep Learning", 2022).

``model.dropout`` drops activations of the towers' hidden layers in training (a forward
hook on each layer: the parameters, their names and their initialization are those of a
model without dropout).

Model code never knows where embedding rows live: it takes pooled tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, InteractionDCNArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet

from recsys.model.config import ModelConfig
from recsys.model.heads import EnsembleMLP, mean_probability_logit


class _PairDots(torch.autograd.Function):
    """``[B, P]``: the dot products of every pair i < j of the ``n`` vectors of ``x`` [B, n, D],
    in ``flat`` order (row-major upper triangle). Its backward is one ``bmm`` with the
    symmetric matrix of the pairs' gradients, Σ_j S_ij x_j (S_ij = S_ji = g_(i,j), S_ii = 0),
    where autograd's backward of ``bmm(x, xᵀ)`` takes two plus an ``index_select``'s
    scatter into zeros: the synthetic job's dense step alone runs faster with this one (an A/B
    run against autograd's backward in one process: docs/benchmarks-history.md, "Trainer")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, flat: torch.Tensor, sym: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, sym)
        return torch.bmm(x, x.transpose(1, 2)).flatten(1).index_select(1, flat)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, sym = ctx.saved_tensors
        n = x.shape[1]
        padded = torch.cat((g, g.new_zeros(g.shape[0], 1)), dim=1)  # column P: the diagonal's 0
        return torch.bmm(padded.index_select(1, sym).view(-1, n, n), x), None, None


class DotInteraction(InteractionArch):
    """torchrec's DLRM interaction, with the upper-triangle gather as one ``index_select``
    and a backward of its own (``_PairDots``).

    Same output as ``InteractionArch`` (tested); its advanced-index gather and the
    ``index_put`` in its backward cost a CPU step several times what a flat ``index_select``
    costs (docs/benchmarks-history.md has the figures).
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__(num_sparse_features)
        n = num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        pairs = torch.arange(rows.numel())
        sym = torch.full((n * n,), rows.numel(), dtype=torch.long)  # the diagonal: the zero column
        sym[rows * n + cols] = pairs
        sym[cols * n + rows] = pairs
        self.register_buffer("flat_triu", rows * n + cols, persistent=False)
        self.register_buffer("sym_triu", sym, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return torch.cat((dense_features, _PairDots.apply(combined, self.flat_triu, self.sym_triu)), dim=1)


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
    null bucket), or a linear map of the piecewise-linear encoding (and a null scalar), or of
    the periodic features: the per-value effect logistic regression on one-hot buckets
    learns, for dense columns.

    ``periodic`` columns (PLR): frequencies ``c`` [E_p, k] from N(0, sigma²), each column's
    own Linear(2k, D) and a ReLU; their parameters are created after every other one, so a
    model without periodic columns is initialized as before them.
    """

    def __init__(self, kinds: list[str], buckets: int, dim: int, wide: bool = False,
                 frequencies: int = 16, sigma: float = 0.1) -> None:
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
            elif kind == "numeric_embedding":
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
                elif kind == "numeric_embedding":
                    proj = nn.Linear(buckets, 1, bias=False)
                    nn.init.zeros_(proj.weight)
                    self.wide_projections.append(proj)
                    self.wide_nulls.append(nn.Parameter(torch.zeros(1)))
        self.register_buffer("steps", torch.arange(buckets, dtype=torch.float32), persistent=False)
        numeric = [e for e, kind in enumerate(kinds) if kind == "numeric_embedding"]
        self.register_buffer("numeric_idx", torch.tensor(numeric, dtype=torch.long), persistent=False)
        periodic = [e for e, kind in enumerate(kinds) if kind == "periodic"]
        if periodic:
            n, k = len(periodic), frequencies
            self.register_buffer("periodic_idx", torch.tensor(periodic, dtype=torch.long), persistent=False)
            self.frequencies = nn.Parameter(torch.randn(n, k) * sigma)
            bound = 1.0 / math.sqrt(2 * k)  # nn.Linear's default initialization, per column
            self.periodic_weight = nn.Parameter(torch.empty(n, 2 * k, dim).uniform_(-bound, bound))
            self.periodic_bias = nn.Parameter(torch.empty(n, dim).uniform_(-bound, bound))
            if wide:
                self.wide_periodic = nn.Parameter(torch.zeros(n, 2 * k))

    def periodic(self, z_BE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return the periodic columns' vectors [B, E_p, D] (PLR) and, with ``wide``, their
        first-order terms [B, E_p], from their standardized values [B, E_p]."""
        angle = (2 * math.pi) * z_BE.unsqueeze(2) * self.frequencies  # [B, E_p, k]
        features = torch.cat((torch.sin(angle), torch.cos(angle)), dim=2)  # [B, E_p, 2k]
        vec = torch.relu(torch.einsum("bef,efd->bed", features, self.periodic_weight) + self.periodic_bias)
        first = (features * self.wide_periodic).sum(dim=2) if self.wide else None
        return vec, first

    def numeric(self, x_BE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return the numeric_embedding columns' vectors [B, E_n, D] and, with ``wide``, their
        first-order terms [B, E_n], from their positions [B, E_n] (null: < 0): every column
        in one batched product over the per-column projections, not a loop of E_n small
        Linears (docs/tuning.md, "Defaults": the loop cost a tenth of a step)."""
        null = (x_BE < 0).unsqueeze(2)
        encoded = (x_BE.unsqueeze(2) - self.steps).clamp(0.0, 1.0)  # [B, E_n, N]
        weight = torch.stack([lin.weight for lin in self.projections])  # [E_n, D, N]
        bias = torch.stack([lin.bias for lin in self.projections])  # [E_n, D]
        vec = torch.einsum("ben,edn->bed", encoded, weight) + bias
        vec = torch.where(null, torch.stack(list(self.null_vectors)), vec)
        if not self.wide:
            return vec, None
        w = torch.stack([lin.weight[0] for lin in self.wide_projections])  # [E_n, N]
        lin = (encoded * w).sum(dim=2)
        return vec, torch.where(null.squeeze(2), torch.cat(list(self.wide_nulls)), lin)

    def forward(self, values_BE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (vectors [B, E, D], first-order term [B] with ``wide``, else None)."""
        out, first, t, p, q = [], [], 0, 0, 0
        if hasattr(self, "periodic_idx"):
            periodic_vec, periodic_first = self.periodic(values_BE.index_select(1, self.periodic_idx))
        if self.numeric_idx.numel():
            numeric_vec, numeric_first = self.numeric(values_BE.index_select(1, self.numeric_idx))
        for e, kind in enumerate(self.kinds):
            x = values_BE[:, e]
            if kind == "periodic":
                out.append(periodic_vec[:, q])
                if self.wide:
                    first.append(periodic_first[:, q])
                q += 1
            elif kind == "quantile_buckets":
                ids = x.long()
                out.append(self.tables[t](ids))
                if self.wide:
                    first.append(self.wide_tables[t](ids).squeeze(1))
                t += 1
            else:
                out.append(numeric_vec[:, p])
                if self.wide:
                    first.append(numeric_first[:, p])
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
        self.raw_dense = cfg.arch == "deepfm" and cfg.deepfm_dense == "raw"  # no bottom MLP
        if cfg.bottom_mlp[-1] != dim and not self.raw_dense:
            raise ValueError(
                f"model.bottom_mlp must end in the embedding dim {dim} (dense and sparse "
                f"vectors meet in one interaction), found {cfg.bottom_mlp}"
            )
        if num_dense <= 0:
            raise ValueError("the model needs at least one dense column")
        from recsys.features.dense import EMBEDDED

        kinds = list(dense_kinds) if dense_kinds is not None else ["signed_log1p"] * num_dense
        if len(kinds) != num_dense:
            raise ValueError(f"dense_kinds has {len(kinds)} entries for {num_dense} dense columns")
        plain = [j for j, k in enumerate(kinds) if k not in EMBEDDED]
        embedded = [j for j, k in enumerate(kinds) if k in EMBEDDED]
        self.split = bool(embedded)
        if self.split:
            self.register_buffer("plain_idx", torch.tensor(plain, dtype=torch.long), persistent=False)
            self.register_buffer("embedded_idx", torch.tensor(embedded, dtype=torch.long), persistent=False)
            self.dense_embeddings = DenseEmbeddings([kinds[j] for j in embedded], buckets, dim, wide=cfg.wide,
                                                    frequencies=cfg.periodic_frequencies, sigma=cfg.periodic_sigma)
        self.num_plain = len(plain)
        if self.raw_dense:  # the paper's DeepFM: plain values into the deep tower and a linear term
            if plain:
                self.dense_linear = nn.Linear(len(plain), 1, bias=False)
                nn.init.zeros_(self.dense_linear.weight)
        else:
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
        elif self.raw_dense:
            inter_out = K * dim + len(plain)
        else:
            self.interaction = FMInteraction()
            inter_out = (K + 1) * dim
        self.heads = cfg.heads
        if cfg.heads == 1:
            self.over_arch = OverArch(inter_out, cfg.top_mlp)
        else:
            self.ensemble = EnsembleMLP(inter_out, cfg.top_mlp, cfg.heads)
        self.register_load_state_dict_pre_hook(_check_heads)
        if cfg.arch == "deepfm":
            self.register_load_state_dict_pre_hook(_check_deepfm_form)
        if cfg.dropout > 0:
            towers = [self.over_arch.model[0]._mlp if cfg.heads == 1 else self.ensemble.hidden()]
            if not self.raw_dense:
                towers.append(self.dense_arch.model._mlp[:-1])  # not the interaction's dense vector
            for tower in towers:
                for layer in tower:
                    layer.register_forward_hook(_dropout_hook(cfg.dropout))

    def forward(self, dense_BN: torch.Tensor, pooled_BFD: torch.Tensor,
                wide_BF1: torch.Tensor | None = None) -> torch.Tensor:
        """``wide_BF1``: the wide arm's pooled weights (required with ``model.wide``).

        With ``model.heads`` K > 1: in training the K heads' logits [B, K], in evaluation the
        logit of their mean probability [B] (``head_logits`` gives [B, K] in either mode)."""
        logits = self.head_logits(dense_BN, pooled_BFD, wide_BF1)
        return logits if self.heads == 1 or self.training else mean_probability_logit(logits)

    def head_logits(self, dense_BN: torch.Tensor, pooled_BFD: torch.Tensor,
                    wide_BF1: torch.Tensor | None = None) -> torch.Tensor:
        """Each head's logit: [B] with one head, [B, K] with K (the shared terms in each)."""
        if self.wide != (wide_BF1 is not None):
            raise ValueError(f"model.wide = {str(self.wide).lower()}: the wide weights must be given "
                             f"{'' if self.wide else 'only '}with the wide arm, found "
                             f"{'none' if wide_BF1 is None else 'some'}")
        logit, first = self._deep(dense_BN, pooled_BFD)
        if wide_BF1 is None:
            return logit
        logit = logit + self._shared(wide_BF1.sum(dim=(1, 2)))
        return logit if first is None else logit + self._shared(first)

    def _top(self, x: torch.Tensor) -> torch.Tensor:
        """The top MLP's logit: [B], or each head's [B, K]."""
        if self.heads == 1:
            return self.over_arch(x).squeeze(-1)
        return self.ensemble(x).squeeze(-1)

    def _shared(self, term_B: torch.Tensor) -> torch.Tensor:
        """A term [B] every head adds to its logit, in the heads' shape."""
        return term_B if self.heads == 1 else term_B.unsqueeze(1)

    def _deep(self, dense_BN: torch.Tensor, pooled_BFD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (the arch's logit [B], the embedded dense columns' first-order term [B] or None)."""
        first = None
        if self.raw_dense:
            return self._deepfm_raw(dense_BN, pooled_BFD)
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
            return self._top(flat) + self._shared(fm), first
        inter = self.interaction(dense_BD, pooled_BFD)
        return self._top(inter), first

    def _deepfm_raw(self, dense_BN: torch.Tensor, pooled_BFD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The paper's DeepFM: deep tower over [fields' vectors, plain values], FM over the
        fields' vectors, a linear term of the plain values (its bias: the top MLP's last)."""
        first, plain = None, dense_BN
        if self.split:
            plain = dense_BN.index_select(1, self.plain_idx)
            vectors, first = self.dense_embeddings(dense_BN.index_select(1, self.embedded_idx))
            pooled_BFD = torch.cat((pooled_BFD, vectors), dim=1)
        logit = self._top(torch.cat((pooled_BFD.flatten(1), plain), dim=1))
        logit = logit + self._shared(fm_second_order(pooled_BFD))
        if self.num_plain:
            logit = logit + self._shared(self.dense_linear(plain).squeeze(-1))
        return logit, first


def _check_deepfm_form(model: RankingModel, state_dict, prefix: str, *args) -> None:
    """Name the setting when a DeepFM checkpoint is of the other ``model.deepfm_dense`` form."""
    saved = any(k.startswith(prefix + "dense_arch.") for k in state_dict)
    if saved == model.raw_dense:
        form, other = ("vector", "raw") if saved else ("raw", "vector")
        raise ValueError(f"the checkpoint holds a DeepFM with model.deepfm_dense = \"{form}\" (a bottom MLP: "
                         f"{'yes' if saved else 'no'}), the job asks for \"{other}\": set model.deepfm_dense = "
                         f"\"{form}\" to load it (\"vector\" was recsys' DeepFM before 2026-11)")


def _check_heads(model: RankingModel, state_dict, prefix: str, *args) -> None:
    """Name the setting when a checkpoint's top MLP has another number of heads than the job's."""
    key = prefix + "ensemble.layers.0.r"
    saved = state_dict[key].shape[0] if key in state_dict else 1
    if not any(k.startswith((prefix + "over_arch.", prefix + "ensemble.")) for k in state_dict):
        return  # not a whole model's state: torch's own error names the missing keys
    if saved != model.heads:
        raise ValueError(f"the checkpoint's model has model.heads = {saved}, the job asks for {model.heads}: "
                         f"set model.heads = {saved} to load it")


def _dropout_hook(rate: float):
    """A forward hook dropping a layer's output activations with ``rate`` in training."""
    def hook(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        return F.dropout(output, rate, module.training)
    return hook


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
    wide arm's store (``recsys.store.tables.wide.PairLookup``), (pooled, wide weights)."""
    wide = getattr(lookup, "wide_pooled", None)
    pooled = lookup.pooled(num_features)
    return (pooled,) if wide is None else (pooled, wide(num_features))
