"""The top MLP as K heads of one BatchEnsemble (``model.heads = K``; TabM, Gorishniy et al.,
"TabM: Advancing Tabular Deep Learning with Parameter-Efficient Ensembling", ICLR 2025).

Every layer has one weight matrix ``W`` [out, in] shared by the K heads and, per head k, a
multiplicative adapter on its input ``r_k`` [in], one on its output ``s_k`` [out] and a bias
``b_k`` [out]: head k's layer is ``((x ⊙ r_k) Wᵀ) ⊙ s_k + b_k``, which is ``x`` times the
weight ``W ⊙ (s_k r_kᵀ)`` (a rank-1 multiplicative change of the shared one). The K heads
see the same input (the interaction's output) and give one logit each, [B, K]: one GEMM of
``B·K`` rows a layer, so a step's top-MLP work is K times one MLP's, its parameters about
one MLP's plus ``K·(in + 2·out)`` a layer.

Initialization (TabM's): ``W`` as ``nn.Linear`` initializes a weight; the first layer's
``r_k`` random signs ±1 (the heads' diversity at the start); every other ``r_k`` and every
``s_k`` ones; each head's biases drawn on their own from ``nn.Linear``'s bias distribution.

Training: each head is trained on its own loss (the loss is the mean of the K heads'
losses; ``recsys.train.loop``). Prediction: the mean of the K heads' probabilities, as TabM
averages its members' predictions (``mean_probability_logit``).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class EnsembleLinear(nn.Module):
    """One BatchEnsemble layer: [B, in] (the heads' shared input) or [B, K, in] → [B, K, out]."""

    def __init__(self, in_features: int, out_features: int, heads: int, *, signs: bool, relu: bool) -> None:
        super().__init__()
        self.relu = relu
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's weight initialization
        r = torch.ones(heads, in_features)
        if signs:
            r = torch.where(torch.rand(heads, in_features) < 0.5, -1.0, 1.0)
        self.r = nn.Parameter(r)
        self.s = nn.Parameter(torch.ones(heads, out_features))
        bound = 1.0 / math.sqrt(in_features)  # nn.Linear's bias initialization, each head its own
        self.bias = nn.Parameter(torch.empty(heads, out_features).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            x = x.unsqueeze(1)  # [B, 1, in]: the same input for every head
        y = torch.addcmul(self.bias, torch.matmul(x * self.r, self.weight.t()), self.s)
        return torch.relu(y) if self.relu else y


class EnsembleMLP(nn.Module):
    """K heads of the MLP ``in_features → sizes``: [B, in] → per-head outputs [B, K, sizes[-1]];
    a ReLU after every layer but the last."""

    def __init__(self, in_features: int, sizes: list[int], heads: int) -> None:
        super().__init__()
        self.heads = heads
        widths = [in_features, *sizes]
        self.layers = nn.ModuleList(
            EnsembleLinear(widths[i], widths[i + 1], heads, signs=i == 0, relu=i < len(sizes) - 1)
            for i in range(len(sizes)))

    def hidden(self) -> list[nn.Module]:
        """The layers whose outputs are hidden activations (dropout's place)."""
        return list(self.layers[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def mean_probability_logit(logits_BK: torch.Tensor) -> torch.Tensor:
    """Return [B]: the logit whose sigmoid is the mean of the K heads' probabilities
    σ(z_k), as log(mean σ(z)) − log(mean σ(−z)) in log-sum-exp form (no overflow; the
    log K of both means cancels)."""
    return (torch.logsumexp(nn.functional.logsigmoid(logits_BK), dim=1)
            - torch.logsumexp(nn.functional.logsigmoid(-logits_BK), dim=1))


def per_head(values_B: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor | None:
    """``values_B`` (labels or sample weights, [B]) as the shape of ``logits``: unchanged for
    one head's [B], repeated for each head's column of [B, K]."""
    if values_B is None or logits.dim() == 1:
        return values_B
    return values_B.unsqueeze(1).expand_as(logits)
