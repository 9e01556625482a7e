"""Model arms: DeepFM's FM term against the explicit pairwise sum, the dense columns'
embeddings (quantile buckets, piecewise-linear numeric embeddings) against hand computation."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from recsys.model.arch import DenseEmbeddings, RankingModel, fm_second_order
from recsys.model.config import ModelConfig


def test_fm_term_equals_the_explicit_pairwise_sum():
    torch.manual_seed(0)
    v = torch.randn(5, 7, 4, dtype=torch.float64)
    explicit = torch.stack([sum((v[b, i] * v[b, j]).sum() for i, j in itertools.combinations(range(7), 2))
                            for b in range(5)])
    torch.testing.assert_close(fm_second_order(v), explicit)


def test_deepfm_logit_is_the_deep_tower_plus_the_fm_term():
    """``deepfm_dense = "vector"``: the bottom MLP's vector joins the FM term and the deep tower
    (the paper's form, ``raw``, is pinned to a reference in test_deepfm_reference.py)."""
    torch.manual_seed(1)
    model = RankingModel(ModelConfig(arch="deepfm", deepfm_dense="vector", bottom_mlp=[8, 4], top_mlp=[16, 1]),
                         3, 2, 4)
    dense = torch.randn(6, 3)
    pooled = torch.randn(6, 2, 4, requires_grad=True)
    logits = model(dense, pooled)
    d = model.dense_arch(dense)
    vectors = torch.cat([d.unsqueeze(1), pooled], dim=1)  # [B, 3, D]
    fm = sum((vectors[:, i] * vectors[:, j]).sum(1) for i, j in itertools.combinations(range(3), 2))
    deep = model.over_arch(vectors.flatten(1)).squeeze(-1)
    torch.testing.assert_close(logits, deep + fm)
    logits.sum().backward()
    assert pooled.grad.abs().sum() > 0 and all(p.grad is not None for p in model.parameters())


def test_dense_embeddings_by_hand():
    torch.manual_seed(2)
    emb = DenseEmbeddings(["quantile_buckets", "numeric_embedding"], buckets=4, dim=3)
    values = torch.tensor([[0.0, 1.5], [4.0, -1.0], [2.0, 4.0]])
    out, first = emb(values)
    assert first is None
    table, proj, null = emb.tables[0].weight, emb.projections[0], emb.null_vectors[0]
    torch.testing.assert_close(out[:, 0], table[[0, 4, 2]])  # bucket ids; 4 = the null bucket
    # piecewise-linear encoding of 1.5 over 4 bins: [1, 0.5, 0, 0]; of 4 (the top): all ones
    enc = torch.tensor([[1.0, 0.5, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(out[[0, 2], 1], proj(enc))
    torch.testing.assert_close(out[1, 1], null.detach())  # a null: the learned null vector


@pytest.mark.parametrize("arch", ["dlrm", "dcn", "deepfm"])
def test_embedded_dense_columns_join_the_interaction(arch):
    torch.manual_seed(3)
    cfg = ModelConfig(arch=arch, bottom_mlp=[8, 4], top_mlp=[16, 1], dcn_low_rank=4)
    kinds = ["quantile_buckets", "signed_log1p", "numeric_embedding"]
    model = RankingModel(cfg, 3, 2, 4, kinds, buckets=4)
    dense = torch.tensor([[0.0, 0.3, 2.5], [4.0, -1.0, -1.0], [3.0, 0.0, 0.0]])
    pooled = torch.randn(3, 2, 4, requires_grad=True)
    logits = model(dense, pooled)
    assert logits.shape == (3,)
    logits.sum().backward()
    assert model.dense_embeddings.tables[0].weight.grad[[0, 4, 3]].abs().sum(1).gt(0).all()
    assert model.dense_embeddings.tables[0].weight.grad[[1, 2]].abs().sum() == 0  # buckets no row fell in
    # every column embedded: the bottom MLP still gives the interaction its (learned, constant) vector
    only = RankingModel(cfg, 2, 2, 4, ["quantile_buckets", "numeric_embedding"], buckets=4)
    assert only(dense[:, [0, 2]], pooled.detach()).shape == (3,)


def test_default_model_is_unchanged_by_the_new_arms():
    """No dense kinds given (or all plain): the same modules, parameters and order as before."""
    cfg = ModelConfig(bottom_mlp=[8, 4], top_mlp=[16, 1])
    torch.manual_seed(4)
    a = RankingModel(cfg, 5, 3, 4)
    torch.manual_seed(4)
    b = RankingModel(cfg, 5, 3, 4, ["signed_log1p"] * 4 + ["standardize"])
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert not any(n.startswith("dense_embeddings") for n, _ in a.named_parameters())
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def _wide_store(optimizer="sgd", lr=0.5):
    from recsys.features.schema import FeatureSpec, Schema, TableSpec
    from recsys.store.config import StoreConfig
    from recsys.store.sharded.store import ShardedEmbeddingStore
    from recsys.store.tables.wide import wide_schema, wide_store_config

    schema = Schema(dense=["x"], tables={"item": TableSpec(dim=4), "user": TableSpec(dim=4)}, sparse=[
        FeatureSpec(name="item"), FeatureSpec(name="user"),
        FeatureSpec(name="hist", table="item", multi_hot=True, pooling="mean")])
    cfg = wide_store_config(StoreConfig(optimizer=optimizer, lr=lr))
    return schema, ShardedEmbeddingStore(wide_schema(schema), cfg)


def test_wide_arm_gradient_matches_a_dense_reference():
    """The wide weights' update through the store (lookup, pooling, push, sparse SGD) equals
    the update of a dense weight vector over the same ids trained by autograd."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    schema, store = _wide_store()
    B = 4
    item = [11, 12, 11, 13]
    user = [7, 7, 8, 9]
    hist = [[12, 14], [], [11, 11, 15], [14]]
    values = item + user + [k for bag in hist for k in bag]
    lengths = [1] * B + [1] * B + [len(b) for b in hist]
    kjt = KeyedJaggedTensor(keys=["item", "user", "hist"], values=torch.tensor(values, dtype=torch.int64),
                            lengths=torch.tensor(lengths, dtype=torch.int32))
    torch.manual_seed(5)
    model = RankingModel(ModelConfig(bottom_mlp=[8, 4], top_mlp=[8, 1], wide=True), 1, 3, 4)
    dense, pooled = torch.randn(B, 1), torch.randn(B, 3, 4)
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    deep = model._deep(dense, pooled)[0].detach()
    try:
        # two steps, so the second starts from weights the first moved away from 0
        ref = {("item.wide", k): torch.zeros(1, dtype=torch.float64, requires_grad=True) for k in (11, 12, 13, 14, 15)}
        ref.update({("user.wide", k): torch.zeros(1, dtype=torch.float64, requires_grad=True) for k in (7, 8, 9)})
        for step in range(2):
            lookup = store.lookup(kjt, step)
            wide = lookup.pooled(3)
            logits = model(dense, pooled, wide)
            torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
            store.push(lookup)
            store.flush()
            ref_logits = []
            for b in range(B):
                s = ref[("item.wide", item[b])] + ref[("user.wide", user[b])]
                if hist[b]:
                    s = s + sum(ref[("item.wide", k)] for k in hist[b]) / len(hist[b])
                ref_logits.append(deep[b].double() + s[0])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(torch.stack(ref_logits), labels.double())
            grads = torch.autograd.grad(loss, list(ref.values()))
            with torch.no_grad():
                for w, g in zip(ref.values(), grads):
                    w -= 0.5 * g
        for table in ("item.wide", "user.wide"):
            keys = np.array([k for t, k in ref if t == table], dtype=np.int64)
            got = store.peek_rows(table, keys)[:, 0]
            want = np.array([ref[(table, k)].item() for k in keys])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
            assert np.abs(want).min() > 0  # every weight moved
    finally:
        store.close()


def test_wide_weights_of_unseen_ids_are_zero():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    _, store = _wide_store()
    try:
        kjt = KeyedJaggedTensor(keys=["item", "user", "hist"], values=torch.tensor([1, 2, 3], dtype=torch.int64),
                                lengths=torch.tensor([1, 1, 1], dtype=torch.int32))
        assert torch.equal(store.lookup(kjt, None, train=False).pooled(3), torch.zeros(1, 3, 1))
    finally:
        store.close()


def test_wide_arm_needs_its_weights():
    model = RankingModel(ModelConfig(bottom_mlp=[8, 4], top_mlp=[8, 1], wide=True), 1, 2, 4)
    with pytest.raises(ValueError, match=r"model.wide = true: the wide weights must be given"):
        model(torch.randn(2, 1), torch.randn(2, 2, 4))


def test_numeric_columns_in_one_product_equal_each_columns_own_projection():
    """The numeric_embedding columns are computed together (one product over stacked weights):
    vectors, first-order terms and every gradient equal each column's own Linear, with nulls
    and another embedded kind interleaved."""
    torch.manual_seed(9)
    kinds = ["numeric_embedding", "quantile_buckets", "numeric_embedding", "numeric_embedding"]
    emb = DenseEmbeddings(kinds, buckets=4, dim=3, wide=True)
    with torch.no_grad():
        for lin in emb.wide_projections:
            lin.weight.normal_()
        for null in emb.wide_nulls:
            null.normal_()
    values = torch.tensor([[0.5, 1.0, 3.2, -1.0], [-1.0, 4.0, 0.0, 2.7], [4.0, 0.0, -1.0, 1.1]])
    out, first = emb(values)
    ref_vec, ref_first = [], []
    for p, e in enumerate([0, 2, 3]):
        x = values[:, e]
        enc = (x.unsqueeze(1) - torch.arange(4.0)).clamp(0.0, 1.0)
        ref_vec.append(torch.where((x < 0).unsqueeze(1), emb.null_vectors[p], emb.projections[p](enc)))
        ref_first.append(torch.where(x < 0, emb.wide_nulls[p], emb.wide_projections[p](enc).squeeze(1)))
    bucket_vec = emb.tables[0](values[:, 1].long())
    bucket_first = emb.wide_tables[0](values[:, 1].long()).squeeze(1)
    ref = torch.stack([ref_vec[0], bucket_vec, ref_vec[1], ref_vec[2]], dim=1)
    ref_f = bucket_first + ref_first[0] + ref_first[1] + ref_first[2]
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(first, ref_f)
    coef = torch.randn_like(out)
    params = list(emb.parameters())
    g = torch.autograd.grad((out * coef).sum() + 0.3 * first.sum(), params)
    g_ref = torch.autograd.grad((ref * coef).sum() + 0.3 * ref_f.sum(), params)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_wide_first_order_of_embedded_dense_columns_by_hand():
    torch.manual_seed(6)
    emb = DenseEmbeddings(["quantile_buckets", "numeric_embedding"], buckets=4, dim=3, wide=True)
    with torch.no_grad():
        emb.wide_tables[0].weight.copy_(torch.arange(5.0).unsqueeze(1) / 10)  # bucket b: b / 10
        emb.wide_projections[0].weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
        emb.wide_nulls[0].fill_(-7.0)
    values = torch.tensor([[0.0, 1.5], [4.0, -1.0], [2.0, 4.0]])
    _, first = emb(values)
    # bucket scalars 0, 0.4, 0.2; encodings [1, .5, 0, 0]·w = 2, null -7, [1, 1, 1, 1]·w = 10
    torch.testing.assert_close(first, torch.tensor([0.0 + 2.0, 0.4 - 7.0, 0.2 + 10.0]))
    model = RankingModel(ModelConfig(bottom_mlp=[8, 3], top_mlp=[8, 1], wide=True), 2, 1, 3,
                         ["quantile_buckets", "numeric_embedding"], buckets=4)
    pooled, wide = torch.randn(3, 1, 3), torch.randn(3, 1, 1)
    logit, first = model._deep(values, pooled)
    torch.testing.assert_close(model(values, pooled, wide), logit + first + wide.sum(dim=(1, 2)))


def test_wide_term_of_an_id_score_list_is_the_scores_times_the_weights():
    """A weighted feature's wide term is Σ score × weight (as its embedding is Σ score × row),
    and its weights' gradient is scaled by the scores: one SGD step, then a lookup."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys.features.schema import FeatureSpec, Schema, TableSpec
    from recsys.store.config import StoreConfig
    from recsys.store.sharded.store import ShardedEmbeddingStore
    from recsys.store.tables.wide import wide_schema, wide_store_config

    schema = Schema(tables={"tag": TableSpec(dim=4)},
                    sparse=[FeatureSpec(name="tags", table="tag", multi_hot=True, weighted=True)])
    store = ShardedEmbeddingStore(wide_schema(schema), wide_store_config(StoreConfig(optimizer="sgd", lr=0.5)))
    scores = [0.5, 2.0, 3.0, 1.5]
    kjt = KeyedJaggedTensor(keys=["tags"], values=torch.tensor([1, 2, 3, 1], dtype=torch.int64),
                            lengths=torch.tensor([2, 2], dtype=torch.int32),
                            weights=torch.tensor(scores, dtype=torch.float32))
    try:
        lookup = store.lookup(kjt, 0)
        pooled = lookup.pooled(1)
        assert torch.equal(pooled.detach(), torch.zeros(2, 1, 1))  # new weights start at 0
        pooled.sum().backward()  # d(sum)/d(weight of id k) = Σ of k's scores over the rows
        store.push(lookup)
        store.flush()
        w = {k: store.peek_rows("tag.wide", np.array([k], dtype=np.int64))[0, 0] for k in (1, 2, 3)}
        np.testing.assert_allclose([w[1], w[2], w[3]], [-0.5 * (0.5 + 1.5), -0.5 * 2.0, -0.5 * 3.0], rtol=1e-6)
        again = store.lookup(kjt, 1).pooled(1).detach()[:, 0, 0].numpy()
        np.testing.assert_allclose(again, [0.5 * w[1] + 2.0 * w[2], 3.0 * w[3] + 1.5 * w[1]], rtol=1e-6)
    finally:
        store.close()


def test_periodic_embeddings_by_hand():
    """PLR: ReLU(Linear_e([sin(2π c_e z), cos(2π c_e z)])) per periodic column, its own c_e;
    with ``wide``, a linear first-order term of the same features."""
    torch.manual_seed(7)
    emb = DenseEmbeddings(["periodic", "quantile_buckets", "periodic"], buckets=4, dim=3, wide=True,
                          frequencies=2, sigma=0.5)
    assert emb.frequencies.shape == (2, 2) and emb.periodic_weight.shape == (2, 4, 3)
    with torch.no_grad():
        emb.wide_periodic.normal_()
    values = torch.tensor([[0.3, 1.0, -2.0], [-1.5, 4.0, 0.0]])
    out, first = emb(values)
    for e, q in ((0, 0), (2, 1)):
        z = values[:, e:e + 1]
        angle = 2 * math.pi * z * emb.frequencies[q]
        feats = torch.cat((torch.sin(angle), torch.cos(angle)), dim=1)
        torch.testing.assert_close(out[:, e], torch.relu(feats @ emb.periodic_weight[q] + emb.periodic_bias[q]))
    torch.testing.assert_close(out[:, 1], emb.tables[0].weight[[1, 4]])
    want = sum((torch.cat((torch.sin(a), torch.cos(a)), 1) * emb.wide_periodic[q]).sum(1)
               for q, a in ((0, 2 * math.pi * values[:, :1] * emb.frequencies[0]),
                            (1, 2 * math.pi * values[:, 2:] * emb.frequencies[1])))
    torch.testing.assert_close(first, want + emb.wide_tables[0].weight[[1, 4], 0])
    (out.sum() + first.sum()).backward()
    assert emb.frequencies.grad.abs().gt(0).all()  # the frequencies are learned


def test_periodic_columns_join_every_arch_and_leave_other_models_as_they_were():
    torch.manual_seed(8)
    kinds = ["periodic", "signed_log1p", "numeric_embedding"]
    for arch in ("dlrm", "dcn", "deepfm"):
        model = RankingModel(ModelConfig(arch=arch, bottom_mlp=[8, 4], top_mlp=[16, 1], dcn_low_rank=4), 3, 2, 4,
                             kinds, buckets=4)
        logits = model(torch.tensor([[0.5, 0.3, 2.5], [-1.0, 0.0, -1.0]]), torch.randn(2, 2, 4))
        logits.sum().backward()
        assert logits.shape == (2,) and model.dense_embeddings.periodic_weight.grad.abs().sum() > 0
    names = [n for n, _ in DenseEmbeddings(["quantile_buckets", "numeric_embedding"], 4, 3).named_parameters()]
    assert not any("periodic" in n or "frequencies" in n for n in names)


@pytest.mark.parametrize("arch", ["dlrm", "dcn", "deepfm"])
def test_dropout_changes_training_forwards_only(arch):
    """``model.dropout``: the same parameters and initialization as without it; evaluation
    forwards equal; training forwards differ; 0 registers nothing."""
    cfg = dict(arch=arch, bottom_mlp=[8, 4], top_mlp=[16, 8, 1], dcn_low_rank=4)
    torch.manual_seed(9)
    plain = RankingModel(ModelConfig(**cfg), 3, 2, 4)
    torch.manual_seed(9)
    dropped = RankingModel(ModelConfig(**cfg, dropout=0.5), 3, 2, 4)
    assert [(n, p.tolist()) for n, p in plain.named_parameters()] == \
        [(n, p.tolist()) for n, p in dropped.named_parameters()]
    assert not any(m._forward_hooks for m in plain.modules())
    hooked = sum(bool(m._forward_hooks) for m in dropped.modules())
    assert hooked == (2 if arch == "deepfm" else 3)  # the top MLP's 2 hidden layers (+ the bottom MLP's first)
    dense, pooled = torch.randn(5, 3), torch.randn(5, 2, 4)
    plain.eval(), dropped.eval()
    torch.testing.assert_close(dropped(dense, pooled), plain(dense, pooled))
    plain.train(), dropped.train()
    assert not torch.allclose(dropped(dense, pooled), plain(dense, pooled))
