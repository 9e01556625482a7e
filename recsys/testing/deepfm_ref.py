"""A reference DeepFM written from its paper, and a plain PyTorch loop that trains it.

Guo, Tang, Ye, Li, He: "DeepFM: A Factorization-Machine based Neural Network for CTR
Prediction", IJCAI 2017. The model, per sample, with F categorical fields (one id each)
and N dense values x:

    e_f = V_f[id_f]                         field embeddings [F, D], shared by FM and DNN
    y_first = Σ_f w_f[id_f] + <a, x>        first order: a scalar per id, linear in x
    y_FM    = Σ_{f<g} <e_f, e_g>            second order, as ½ Σ_d((Σ_f e_fd)² − Σ_f e_fd²)
    y_DNN   = MLP([e_1, ..., e_F, x])       ReLU hidden layers, a linear output
    logit   = b + y_first + y_FM + y_DNN

Every parameter is a dense torch parameter (the tables too: ``nn.Embedding`` over a
vocabulary of the training split's ids, row 0 for an id the training split lacks),
trained by one Adam with an L2 penalty on the embedding and first-order tables. Nothing
here comes from recsys' model, store or trainer. ``compare`` trains this and recsys'
``model.arch = "deepfm"`` on the same splits of a ``recsys bench quality`` set::

    .venv/bin/python -c "from recsys.testing import deepfm_ref; deepfm_ref.compare('flights')"

and ``tests/test_deepfm_reference.py`` pins recsys' forward to this one's on copied weights.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn


class ReferenceDeepFM(nn.Module):
    """DeepFM of the paper (see the module docstring): ``forward(ids [B, F] long, dense [B, N])``."""

    def __init__(self, vocab_sizes: list[int], dim: int, num_dense: int, hidden: list[int],
                 init_std: float = 1e-4, dropout: float = 0.0) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(v, dim) for v in vocab_sizes)
        self.weights = nn.ModuleList(nn.Embedding(v, 1) for v in vocab_sizes)
        self.dense_weight = nn.Linear(num_dense, 1, bias=False)
        self.bias = nn.Parameter(torch.zeros(1))
        layers: list[nn.Module] = []
        width = len(vocab_sizes) * dim + num_dense
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        self.hidden = nn.Sequential(*layers)
        self.out = nn.Linear(width, 1, bias=False)
        for table in (*self.embeddings, *self.weights):
            nn.init.normal_(table.weight, std=init_std)
        nn.init.normal_(self.dense_weight.weight, std=init_std)

    def field_vectors(self, ids_BF: torch.Tensor) -> torch.Tensor:
        """Return the field embeddings [B, F, D]."""
        return torch.stack([table(ids_BF[:, f]) for f, table in enumerate(self.embeddings)], dim=1)

    def forward(self, ids_BF: torch.Tensor, dense_BN: torch.Tensor) -> torch.Tensor:
        e = self.field_vectors(ids_BF)
        first = sum(w(ids_BF[:, f]).squeeze(1) for f, w in enumerate(self.weights)) + \
            self.dense_weight(dense_BN).squeeze(1)
        total = e.sum(dim=1)
        fm = 0.5 * (total * total - (e * e).sum(dim=1)).sum(dim=1)
        deep = self.out(self.hidden(torch.cat((e.flatten(1), dense_BN), dim=1))).squeeze(1)
        return self.bias + first + fm + deep

    def l2(self) -> torch.Tensor:
        """Σ of the squared embedding and first-order weights (every row, as the paper's
        regularized objective)."""
        return sum((t.weight * t.weight).sum() for t in (*self.embeddings, *self.weights))


@dataclass
class Settings:
    """How the reference trains (defaults: the paper's Adam and common DeepFM defaults)."""

    dim: int = 16
    hidden: tuple[int, ...] = (128, 64)
    lr: float = 1e-3
    batch_size: int = 512
    l2: float = 1e-5
    """L2 penalty of the embedding and first-order tables (the loss's mean over the batch plus l2 · Σ w²)."""
    init_std: float = 1e-4
    dropout: float = 0.0
    epochs: int = 15
    patience: int = 3
    """Early stopping: epochs in a row without a better validation AUC."""
    threads: int = 1


def _encode(train: np.ndarray, *others: np.ndarray) -> tuple[int, list[np.ndarray]]:
    """Return (vocabulary size, each array's indices): the training split's ids → 1..V, others → 0."""
    vocab = np.unique(train)
    out = []
    for a in (train, *others):
        pos = np.searchsorted(vocab, a)
        hit = (pos < vocab.shape[0]) & (vocab[np.minimum(pos, vocab.shape[0] - 1)] == a)
        out.append(np.where(hit, pos + 1, 0).astype(np.int64))
    return vocab.shape[0] + 1, out


def load_splits(root: Path, label: str, dense: list[str], ids: list[str]) -> dict:
    """Return the three splits under ``root`` as tensors: ids encoded by the training split's
    vocabulary, dense values standardized by its mean and std (nulls: 0 first), as recsys'
    ``schema.dense_transform = "standardize"`` does."""
    from recsys.bench.quality import _read_split

    splits = {s: _read_split([str(root / s)], [label, *dense, *ids]) for s in ("train", "validation", "eval")}
    names = ("train", "validation", "eval")
    vocab, encoded = [], {s: [] for s in names}
    for c in ids:
        size, arrays = _encode(*(np.asarray(splits[s][c], dtype=np.int64) for s in names))
        vocab.append(size)
        for s, a in zip(names, arrays):
            encoded[s].append(a)
    x = {s: np.stack([np.nan_to_num(np.asarray(splits[s][c], dtype=np.float64)) for c in dense], axis=1)
         for s in names}
    mean, std = x["train"].mean(axis=0), x["train"].std(axis=0)
    std[std == 0] = 1.0
    return {"vocab": vocab, **{s: (torch.from_numpy(np.stack(encoded[s], axis=1)),
                                   torch.from_numpy(((x[s] - mean) / std).astype(np.float32)),
                                   torch.from_numpy(np.asarray(splits[s][label], dtype=np.float32)))
                               for s in names}}


@torch.no_grad()
def _scores(model: nn.Module, split, batch: int = 8192) -> np.ndarray:
    model.eval()
    ids, dense, _ = split
    out = [torch.sigmoid(model(ids[i:i + batch], dense[i:i + batch])) for i in range(0, ids.shape[0], batch)]
    model.train()
    return torch.cat(out).double().numpy()


def train_reference(data: dict, settings: Settings, seed: int) -> dict:
    """Train the reference on ``load_splits`` output with ``seed``; return the eval split's
    AUC and log loss of the epoch with the best validation AUC."""
    from recsys.eval.metrics import evaluate_predictions

    torch.set_num_threads(settings.threads)
    torch.manual_seed(seed)
    ids, dense, label = data["train"]
    model = ReferenceDeepFM(data["vocab"], settings.dim, dense.shape[1], list(settings.hidden),
                            settings.init_std, settings.dropout)
    opt = torch.optim.Adam(model.parameters(), lr=settings.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(seed)
    best, best_state, since, history = -math.inf, None, 0, []
    t0 = time.perf_counter()
    for epoch in range(settings.epochs):
        order = torch.randperm(ids.shape[0], generator=gen)
        for i in range(0, ids.shape[0], settings.batch_size):
            rows = order[i:i + settings.batch_size]
            loss = loss_fn(model(ids[rows], dense[rows]), label[rows])
            if settings.l2:
                loss = loss + settings.l2 * model.l2()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        auc = evaluate_predictions(data["validation"][2].numpy(), _scores(model, data["validation"]))["auc"]
        history.append(auc)
        if auc > best:
            best, best_state, since = auc, copy.deepcopy(model.state_dict()), 0
        else:
            since += 1
            if since >= settings.patience:
                break
    model.load_state_dict(best_state)
    scored = evaluate_predictions(data["eval"][2].numpy(), _scores(model, data["eval"]))
    return {"auc": scored["auc"], "log_loss": scored["log_loss"], "best_validation_auc": best,
            "best_epoch": int(np.argmax(history)) + 1, "epochs": len(history), "validation": history,
            "seconds": time.perf_counter() - t0}


OURS = ("schema.dense_transform='standardize'", "model.arch='deepfm'", "train.epochs=15",
        "train.eval.early_stopping_patience=3", "train.runtime.threads=1")
"""recsys' side of ``compare``: the set's job (its store, wide arm, towers, batch) as DeepFM
over standardized dense values (the reference's inputs), the reference's epoch budget."""


def reference_overrides(job_path: Path, settings: Settings) -> tuple[str, ...]:
    """The overrides that make the job at ``job_path`` (with ``OURS``) train as the reference
    does with ``settings``: its tables' dim, its deep tower, batch size and dropout, Adam for
    the tables and the dense tower at its learning rate and nothing else (no warm-up, decay,
    clipping or dense weight decay), its L2 penalty as the store's weight decay (the gradient
    of ``l2 · Σ w²`` is ``2 · l2 · w``), the wide arm included, and its initial spread
    (U(-a, a) of std ``init_std``: ``a = √3 · init_std``).

    What stays recsys' own is the implementation: the store, the model's forward and the
    trainer. So the store's Adam and weight decay act on the rows a batch touches (the
    reference's on every row, each step), and the wide weights start at 0. With these,
    ``compare`` measures that; with ``OURS`` alone it measures the set's job's settings too."""
    from recsys.config import load_job

    job = load_job(job_path, list(OURS))
    tables = [f"schema.tables.{name}.dim={settings.dim}" for name in job.schema.tables]
    return (*OURS, *tables, f"model.top_mlp={[*settings.hidden, 1]}", f"model.dropout={settings.dropout}",
            "model.wide=true", f"model.wide_lr={settings.lr}",
            f"model.wide_weight_decay={2 * settings.l2}", f"data.train.batch_size={settings.batch_size}",
            "store.optimizer='adam'", f"store.lr={settings.lr}", f"store.weight_decay={2 * settings.l2}",
            f"store.init_scale={math.sqrt(3) * settings.init_std}", "train.optim.name='adam'",
            f"train.optim.lr={settings.lr}", "train.optim.weight_decay=0.0", "train.optim.clip_grad_norm=0.0",
            "train.schedule.warmup_steps=0", "train.schedule.decay='none'")


def compare(name: str = "flights", seeds=(0, 1, 2), settings: Settings | None = None,
            ours: tuple[str, ...] = OURS, matched: bool = True) -> dict:
    """Train the reference and recsys' DeepFM on the splits of ``recsys bench quality``'s set
    ``name``, each with ``seeds``, both epochs chosen by validation AUC; print and return the
    eval split's AUC (mean ± std) of each. recsys' DeepFM trains twice: as the set's job
    writes it (``ours``: its dims, towers, batch and store) and, with ``matched``, with the
    reference's settings (``reference_overrides``): the first measures what a user of the job
    gets, the second our DeepFM against the paper's at one setting."""
    from recsys.bench import quality

    s = quality.SETS[name]
    root = quality.prepare(s)
    settings = settings or Settings()
    data = load_splits(root, "label", list(s.dense), list(s.ids))
    ref = [train_reference(data, settings, seed) for seed in seeds]
    paths = [f"data.train.paths=['{root / 'train'}']", f"data.validation.paths=['{root / 'validation'}']",
             f"data.eval.paths=['{root / 'eval'}']"]
    out_root = quality.RUNS / "deepfm-reference" / time.strftime("%Y%m%d-%H%M%S")
    arms = {"ours": ours}
    if matched:
        arms["ours_matched"] = reference_overrides(quality.ROOT / s.job, settings)
    result = {"set": name, "seeds": list(seeds), "reference": {"runs": ref, **quality._summary(ref)},
              "settings": dataclasses.asdict(settings)}
    for arm, overrides in arms.items():
        runs = [quality.train_ours(quality.ROOT / s.job, seed, out_root / arm / f"seed-{seed}", [*paths, *overrides])
                for seed in seeds]
        result[arm] = {"runs": runs, **quality._summary(runs), "overrides": list(overrides)}
    for side in ("reference", *arms):
        r = result[side]
        print(f"{name} {side:<12}  eval AUC {r['auc_mean']:.4f} ± {r['auc_std']:.4f}  "
              "(" + ", ".join(f"{x['auc']:.4f}" for x in r["runs"]) + ")", flush=True)
    return result
