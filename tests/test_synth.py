"""Synthetic data: deterministic, Criteo-like layout, and an oracle that bounds every model."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from recsys.io import synth
from recsys.config import load_job
from recsys.io.synth import PRESETS, generate, log_loss, roc_auc, signed_log1p

DENSE = [f"i{i}" for i in range(1, 14)]
CATS = [f"c{i}" for i in range(1, 27)]
STRING_CATS = {"c3", "c9", "c16", "c22"}
JOBS = Path(__file__).resolve().parent.parent / "jobs"


def _read_split(root: Path, split: str) -> pa.Table:
    files = sorted((root / split).glob("*.parquet"))
    return pa.concat_tables(pq.read_table(f) for f in files)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tiny")
    return out, generate("tiny", out, seed=0)


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_rows_other_seed_other_rows(tiny, tmp_path):
    out, oracle = tiny
    again = generate("tiny", tmp_path / "again", seed=0)
    other = generate("tiny", tmp_path / "other", seed=1)
    for split in ("train", "eval"):
        a = _read_split(out, split)
        assert a.equals(_read_split(tmp_path / "again", split))
        b = _read_split(tmp_path / "other", split)
        assert a.schema == b.schema
        assert not a.column("c1").equals(b.column("c1"))
        assert not a.column("label").equals(b.column("label"))
    # Same seed: byte-identical files, same oracle.
    for f in sorted(out.rglob("*.parquet")):
        assert f.read_bytes() == (tmp_path / "again" / f.relative_to(out)).read_bytes()
    assert again == oracle
    assert other["eval"]["auc"] != oracle["eval"]["auc"]


def _group_sizes(path: Path) -> list[int]:
    md = pq.ParquetFile(path).metadata
    return [md.row_group(i).num_rows for i in range(md.num_row_groups)]


@pytest.mark.parametrize(
    ("row_group_size", "rows_per_file", "groups"),
    [(300, 1_000, [300, 300, 300, 100]), (5_000, 1_000, [1_000]), (1_000, 1_000, [1_000])],
)
def test_layout_choices_do_not_change_the_rows(tiny, tmp_path, row_group_size, rows_per_file, groups):
    out, _ = tiny
    oracle = generate("tiny", tmp_path, seed=0, row_group_size=row_group_size, rows_per_file=rows_per_file)
    assert oracle["train"]["files"] == 6 and oracle["eval"]["files"] == 2
    for split in ("train", "eval"):
        assert _read_split(tmp_path, split).equals(_read_split(out, split))
    for f in (tmp_path / "train").glob("*.parquet"):
        assert _group_sizes(f) == groups
    assert oracle["eval"] == {**tiny[1]["eval"], "files": 2}


def test_streaming_across_generation_chunks(tmp_path, monkeypatch):
    # Small chunks (this changes the rows, by definition) so files and row groups straddle them.
    monkeypatch.setattr(synth, "GEN_CHUNK_ROWS", 700)
    oracle = generate("tiny", tmp_path)
    files = sorted((tmp_path / "train").glob("*.parquet"))
    assert [_group_sizes(f) for f in files] == [[512, 512, 476]] * 4
    ids = _read_split(tmp_path, "train").column("row_id").to_numpy()
    assert np.array_equal(ids, np.arange(oracle["train"]["rows"]))


def test_regenerating_replaces_stale_files(tmp_path):
    generate("tiny", tmp_path, rows_per_file=500)
    assert len(list((tmp_path / "train").glob("*.parquet"))) == 12
    generate("tiny", tmp_path)
    assert len(list((tmp_path / "train").glob("*.parquet"))) == 4
    assert not list(tmp_path.rglob("*.tmp"))


# --------------------------------------------------------------------------- layout


def test_files_row_groups_and_compression(tiny):
    out, oracle = tiny
    p = PRESETS["tiny"]
    train_files = sorted((out / "train").glob("*.parquet"))
    assert len(train_files) == oracle["train"]["files"] >= 4
    assert len(sorted((out / "eval").glob("*.parquet"))) == oracle["eval"]["files"] >= 2
    for f in train_files:
        md = pq.ParquetFile(f).metadata
        assert md.num_rows == p.rows_per_file
        sizes = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        assert sizes[:-1] == [p.row_group_size] * (len(sizes) - 1) and 0 < sizes[-1] <= p.row_group_size
        rg = md.row_group(0)
        assert {rg.column(j).compression for j in range(rg.num_columns)} == {"ZSTD"}
    assert oracle["row_group_size"] == p.row_group_size and oracle["rows_per_file"] == p.rows_per_file
    assert json.loads((out / "oracle.json").read_text()) == oracle


def test_columns_and_types(tiny):
    out, _ = tiny
    schema = pq.read_schema(sorted((out / "train").glob("*.parquet"))[0])
    expected = ["row_id", "label", *DENSE, *CATS, "m1", "m2"]
    assert schema.names == expected
    assert schema.field("row_id").type == pa.int64()
    assert schema.field("label").type == pa.int8()
    for c in DENSE:
        assert schema.field(c).type == pa.float32()
    for c in CATS:
        assert schema.field(c).type == (pa.string() if c in STRING_CATS else pa.int64()), c
    assert schema.field("m1").type == pa.list_(pa.int64())
    assert schema.field("m2").type == pa.list_(pa.string())


def test_row_ids_unique_across_splits(tiny):
    out, oracle = tiny
    ids = np.concatenate([_read_split(out, s).column("row_id").to_numpy() for s in ("train", "eval")])
    assert ids.size == PRESETS["tiny"].train_rows + PRESETS["tiny"].eval_rows
    assert np.unique(ids).size == ids.size
    assert oracle["eval"]["row_id_start"] == oracle["train"]["rows"]


def test_values_look_like_ctr_data(tiny):
    out, _ = tiny
    t = _read_split(out, "train")
    labels = t.column("label").to_numpy()
    assert set(np.unique(labels)) == {0, 1}
    for c in DENSE:
        x = t.column(c).drop_null().to_numpy()
        assert np.all(np.isfinite(x)), c
    assert sum(t.column(c).null_count > 0 for c in DENSE) >= 5
    assert min(t.column(c).null_count for c in DENSE) == 0
    # Heavy tails: a huge max against a modest median.
    i5 = t.column("i5").drop_null().to_numpy()
    assert i5.max() > 50 * np.median(i5)
    assert t.column("i2").drop_null().to_numpy().min() < 0

    for c in CATS:
        col = t.column(c)
        assert col.null_count < 0.1 * t.num_rows, c
        if c in STRING_CATS:
            lengths = pc.utf8_length(col.drop_null()).to_numpy()
            assert np.all(lengths == 8), c
            assert pc.all(pc.match_substring_regex(col.drop_null(), "^[0-9a-f]{8}$")).as_py()
    assert sum(t.column(c).null_count > 0 for c in CATS) >= 8
    # Zipf: a few ids dominate, many appear; ids are scrambled, not 1..n.
    c7 = t.column("c7").to_numpy()
    _, counts = np.unique(c7, return_counts=True)
    assert counts.max() > 0.05 * c7.size and counts.size > 300
    assert np.median(np.abs(c7)) > 10**6

    for m in ("m1", "m2"):
        col = t.column(m)
        assert 0 < col.null_count < 0.05 * t.num_rows, m
        n = pc.list_value_length(col).fill_null(-1).to_numpy()
        assert np.sum(n == 0) > 0.02 * t.num_rows, m  # empty, non-null bags
        assert 3 < n[n >= 0].mean() < 7 and n.max() <= 20, m
        assert col.combine_chunks().flatten().null_count == 0


# --------------------------------------------------------------------------- oracle


def test_oracle_sanity(tiny):
    _, oracle = tiny
    ev, tr = oracle["eval"], oracle["train"]
    assert oracle["preset"] == "tiny" and oracle["seed"] == 0
    assert oracle["version"] == synth.GENERATOR_VERSION
    assert 0.5 < ev["auc"] < 1
    assert ev["log_loss"] < ev["constant_log_loss"]
    assert 0 < ev["normalized_entropy"] < 1
    for split in (tr, ev):
        assert 0.10 < split["base_ctr"] < 0.25
    b = ev["base_ctr"]
    assert ev["constant_log_loss"] == pytest.approx(-(b * np.log(b) + (1 - b) * np.log(1 - b)))
    assert ev["normalized_entropy"] == pytest.approx(ev["log_loss"] / ev["constant_log_loss"])


def _standardized_dense(t: pa.Table, mu=None, sd=None):
    x = np.stack([signed_log1p(t.column(c).fill_null(0).to_numpy()) for c in DENSE], axis=1)
    if mu is None:
        mu, sd = x.mean(0), x.std(0) + 1e-9
    return np.c_[np.ones(len(x)), (x - mu) / sd], mu, sd


def test_dense_only_logistic_regression_stays_below_the_oracle(tiny):
    out, oracle = tiny
    train, ev = _read_split(out, "train"), _read_split(out, "eval")
    x, mu, sd = _standardized_dense(train)
    y = train.column("label").to_numpy().astype(float)
    w = np.zeros(x.shape[1])
    for _ in range(25):  # Newton steps with a small ridge
        p = 1 / (1 + np.exp(-x @ w))
        hess = x.T @ (x * (p * (1 - p))[:, None]) + 1e-3 * np.eye(x.shape[1])
        w -= np.linalg.solve(hess, x.T @ (p - y) + 1e-3 * w)
    xe, _, _ = _standardized_dense(ev, mu, sd)
    ye = ev.column("label").to_numpy()
    pe = 1 / (1 + np.exp(-xe @ w))
    auc = roc_auc(ye, pe)
    assert 0.52 < auc < oracle["eval"]["auc"] - 0.05
    assert log_loss(ye, pe) > oracle["eval"]["log_loss"]


def test_hidden_effects_are_functions_of_seed_feature_and_rank():
    plan_a = synth._make_plan(PRESETS["tiny"], 0)
    plan_b = synth._make_plan(PRESETS["tiny"], 0)
    plan_c = synth._make_plan(PRESETS["tiny"], 1)
    ranks = np.array([0, 5, 3, 0, 9_999], dtype=np.int64)
    a = synth._effects(plan_a.columns["c12"], ranks)
    assert np.array_equal(a, synth._effects(plan_b.columns["c12"], ranks))
    assert a[0] == a[3]
    assert not np.array_equal(a, synth._effects(plan_c.columns["c12"], ranks))
    # Rare ids have shrunk effects.
    big = np.arange(10**6, 10**6 + 5000, dtype=np.int64)
    small = np.arange(0, 5000, dtype=np.int64)
    col = synth._make_plan(PRESETS["small"], 0).columns["c12"]
    assert np.abs(synth._effects(col, big)).mean() < 0.01 * np.abs(synth._effects(col, small)).mean()


def test_scramble_is_a_bijection():
    ranks = np.arange(200_000, dtype=np.int64)
    for bits in (32, 40):
        ids = synth._scramble(ranks, bits, 12345)
        assert np.unique(ids).size == ranks.size and ids.max() < 2**bits
        assert not np.array_equal(ids, synth._scramble(ranks, bits, 54321))


# --------------------------------------------------------------------------- metrics


def test_roc_auc_matches_pairwise_count_with_ties():
    rng = np.random.default_rng(0)
    y = rng.random(400) < 0.3
    s = rng.integers(0, 12, 400).astype(float)  # many ties
    pos, neg = s[y], s[~y]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        pos.size * neg.size
    )
    assert roc_auc(y, s) == pytest.approx(brute, abs=1e-12)
    assert roc_auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert roc_auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        roc_auc([1, 1], [0.1, 0.2])


def test_log_loss():
    assert log_loss([1, 0], [0.5, 0.5]) == pytest.approx(np.log(2))
    assert np.isfinite(log_loss([1, 0], [0.0, 1.0]))


# --------------------------------------------------------------------------- arguments and jobs


def test_unknown_preset_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*tiny, small, large"):
        generate("huge", tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("kwargs", [{"row_group_size": 0}, {"rows_per_file": -1}, {"seed": -1}])
def test_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        generate("tiny", tmp_path, **kwargs)


def test_progress_reports_each_file(tmp_path):
    lines = []
    oracle = generate("tiny", tmp_path, progress=lines.append)
    written = [line for line in lines if line.startswith("wrote ")]
    assert len(written) == oracle["train"]["files"] + oracle["eval"]["files"]


@pytest.mark.parametrize("size", ["tiny", "small", "large"])
def test_job_file_matches_the_generated_columns(tiny, size):
    out, oracle = tiny
    job = load_job(JOBS / f"synthetic_{size}.toml")
    assert job.data.train.paths == [f"data/synthetic_{size}/train"]
    assert job.data.eval.paths == [f"data/synthetic_{size}/eval"]
    assert job.data.eval.passthrough == ["row_id"]  # training reads no passthrough column (cost)
    schema = pq.read_schema(sorted((out / "train").glob("*.parquet"))[0])
    s = job.schema
    assert s.label == "label" and s.dense == DENSE
    assert sorted(f.column for f in s.sparse) == sorted([*CATS, "m1", "m2"])
    for f in s.sparse:
        t = schema.field(f.column).type
        assert f.multi_hot == pa.types.is_list(t), f.name
        value_type = t.value_type if f.multi_hot else t
        assert f.kind == ("string" if value_type == pa.string() else "int64"), f.name
        assert s.tables[f.table].dim == 16
        card = oracle["features"][f.column]["cardinality"] if size == "tiny" else None
        if card is not None:
            assert s.tables[f.table].capacity >= card


def test_generate_accepts_a_custom_preset(tmp_path):
    custom = synth.Preset(name="custom", train_rows=900, eval_rows=300, rows_per_file=500, row_group_size=200)
    oracle = synth.generate(custom, tmp_path)
    assert oracle["preset"] == "custom"
    assert oracle["train"]["rows"] == 900 and oracle["eval"]["rows"] == 300


# --------------------------------------------------------------------------- the Zipf law


def test_zipf_ranks_keep_their_draws():
    """The synthetic data's ids (and the benches' traces) are these draws: a change to the
    sampler changes every generated data set and its oracle."""
    from recsys.io.zipf import zipf_ranks

    assert zipf_ranks(np.random.default_rng(0), 12, 1000, 1.2).tolist() == [15, 1, 0, 0, 77, 257, 11, 33, 7, 351, 79, 0]
    assert zipf_ranks(np.random.default_rng(0), 12, 2_000_000, 1.05).tolist() == [
        1977, 10, 0, 0, 42342, 300958, 1220, 9313, 463, 480404, 44449, 0]
    assert int(zipf_ranks(np.random.default_rng(0), 20_000, 1000, 1.2).sum()) == 1_375_718


@pytest.mark.parametrize("s", [0.8, 1.0, 1.05, 1.3])
def test_zipf_ranks_follow_the_rounded_power_law(s):
    """Rank r (1-based) is drawn with probability ∫ x**-s over [r - 0.5, r + 0.5) / Z, Z =
    ``zipf_norm`` (s = 1 included: the log-uniform limit); every rank in range."""
    from recsys.io.zipf import zipf_norm, zipf_ranks

    card, n = 50, 400_000
    ranks = zipf_ranks(np.random.default_rng(7), n, card, s)
    assert ranks.dtype == np.int64 and ranks.min() >= 0 and ranks.max() < card
    edges = np.arange(card + 1) + 0.5
    mass = np.diff(np.log(edges)) if s == 1.0 else np.diff(edges ** (1.0 - s)) / (1.0 - s)
    assert mass.sum() == pytest.approx(zipf_norm(card, s))
    want = mass / mass.sum()
    got = np.bincount(ranks, minlength=card) / n
    np.testing.assert_allclose(got, want, atol=4 * np.sqrt(want.max() / n))
