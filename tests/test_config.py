"""Job config loading, overrides and their errors."""

import pytest

from recsys import config
from recsys.config import ConfigError, JobConfig, load_job

JOB = """
name = "t"
[schema]
dense = ["i1", "i2"]
[schema.tables.item]
dim = 8
capacity = 100
[[schema.sparse]]
name = "item"
column = "item_id"
[[schema.sparse]]
name = "hist"
multi_hot = true
kind = "string"
table = "item"
[data.train]
paths = ["x/train"]
batch_size = 32
"""


@pytest.fixture
def job_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    return path


def test_load_job_builds_typed_sections(job_file):
    job = load_job(job_file)
    assert job.name == "t"
    assert job.schema.feature("hist").table == "item"
    assert job.schema.feature("hist").column == "hist"
    assert job.schema.columns(["row_id"]) == ["label", "i1", "i2", "item_id", "hist", "row_id"]
    assert job.data.train.batch_size == 32
    assert job.data.eval.shuffle is False


def test_overrides_are_parsed_as_toml_values(job_file):
    job = load_job(
        job_file,
        [
            "data.train.batch_size=64",
            "data.train.shuffle=false",
            "data.train.paths=['a', 'b']",
            "name=plain-string",
            "schema.tables.item.dim=4",
        ],
    )
    assert job.data.train.batch_size == 64
    assert job.data.train.shuffle is False
    assert job.data.train.paths == ["a", "b"]
    assert job.name == "plain-string"
    assert job.schema.tables["item"].dim == 4


def test_unknown_key_in_file_lists_valid_keys(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[data.train]\nbatchsize = 3\n")
    with pytest.raises(ConfigError) as exc:
        load_job(path)
    msg = str(exc.value)
    assert "data.train" in msg and "batchsize" in msg and "batch_size" in msg and str(path) in msg


def test_unknown_override_key_lists_valid_keys(job_file):
    with pytest.raises(ConfigError, match=r"unknown key 'batchsize' in data.train; valid keys are \[.*'batch_size'"):
        load_job(job_file, ["data.train.batchsize=3"])
    with pytest.raises(ConfigError, match=r"unknown key 'nope' in top level"):
        load_job(job_file, ["nope.x=1"])


def test_wrong_types_name_the_path_and_expected_type(job_file):
    with pytest.raises(ConfigError, match=r"data.train.batch_size: expected an int, found string 'many'"):
        load_job(job_file, ["data.train.batch_size=many"])
    with pytest.raises(ConfigError, match=r"data.train.shuffle: expected a bool"):
        load_job(job_file, ["data.train.shuffle=1"])
    with pytest.raises(ConfigError, match=r"on_bad_file: expected one of \['error', 'skip'\]"):
        load_job(job_file, ["data.train.on_bad_file=ignore"])
    with pytest.raises(ConfigError, match=r"schema.dense_fill_null: expected a float"):
        load_job(job_file, ["schema.dense_fill_null=true"])


def test_int_is_accepted_for_float(job_file):
    assert load_job(job_file, ["schema.dense_fill_null=1"]).schema.dense_fill_null == 1.0


def test_post_init_checks_become_config_errors(job_file):
    with pytest.raises(ConfigError, match=r"batch_size must be > 0, found 0"):
        load_job(job_file, ["data.train.batch_size=0"])
    with pytest.raises(ConfigError, match=r"dim must be > 0"):
        load_job(job_file, ["schema.tables.item.dim=-1"])


def test_schema_rejects_undeclared_table_and_duplicates():
    with pytest.raises(ConfigError, match=r"looks up table 'nope', which is not declared"):
        config.from_dict(JobConfig, {"schema": {"sparse": [{"name": "a", "table": "nope"}]}})
    with pytest.raises(ConfigError, match=r"names must be unique"):
        config.from_dict(
            JobConfig,
            {"schema": {"tables": {"a": {"dim": 2}}, "sparse": [{"name": "a"}, {"name": "a"}]}},
        )
    with pytest.raises(ConfigError, match=r"used by no feature"):
        config.from_dict(JobConfig, {"schema": {"tables": {"a": {"dim": 2}}}})


def test_malformed_override_and_toml(tmp_path, job_file):
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_job(job_file, ["data.train.batch_size"])
    bad = tmp_path / "broken.toml"
    bad.write_text("[data\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_job(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_job(tmp_path / "missing.toml")


def test_resolved_config_round_trips(job_file, tmp_path):
    job = load_job(job_file, ["data.train.batch_size=7"])
    path = config.write_resolved(job, tmp_path / "run")
    assert load_job(path) == job
