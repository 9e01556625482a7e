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


# --------------------------------------------------------------------------- keys that moved


def test_a_moved_key_in_a_job_file_fails_with_one_line_naming_its_new_place(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text(JOB + '[store]\nlr = 0.1\nspill_url = "redis://cache:6379/0"\n')
    with pytest.raises(ConfigError) as exc:
        load_job(path)
    assert str(exc.value) == f"{path}: store.spill_url: moved to store.spill.url"
    path.write_text(JOB + "[train]\neval_every = 5\nlr = 0.01\nthreads = 1\n")  # several: all in one line
    with pytest.raises(ConfigError) as exc:
        load_job(path)
    assert str(exc.value) == (f"{path}: train.lr: moved to train.optim.lr; train.eval_every: moved to train.eval.every; "
                              "train.threads: moved to train.runtime.threads")


def test_a_moved_key_in_an_override_fails_with_one_line_naming_its_new_place(job_file):
    from recsys.errors import user_message

    with pytest.raises(ConfigError) as exc:
        load_job(job_file, ["store.spill_url='redis://:secret@cache:6379/0'"])
    message = user_message(exc.value)
    assert message.endswith(": store.spill_url: moved to store.spill.url") and "\n" not in message
    assert "secret" not in message  # the override is quoted redacted, as every user error is
    with pytest.raises(ConfigError, match=r"^--set 'train.keep_best=\"auc\"': train.keep_best: moved to "
                                          r"train.eval.keep_best$"):
        load_job(job_file, ['train.keep_best="auc"'])


def test_every_moved_key_names_a_key_that_exists_now_and_its_old_path_does_not(job_file):
    from recsys.config import MOVED, apply_overrides

    assert len(MOVED) == 43
    for old, new in MOVED.items():
        apply_overrides({}, [f"{new}=0"], JobConfig)  # the new path is a key of the job
        with pytest.raises(ConfigError, match=f": {old}: moved to {new}$"):
            apply_overrides({}, [f"{old}=0"], JobConfig)


def test_a_checkpoint_saved_with_flat_keys_is_read_with_them_in_their_new_places(job_file):
    import tomllib

    import tomli_w

    from recsys.config import MOVED, dumps, saved_job

    job = load_job(job_file, ["store.spill.url='redis://cache:6379/0'", "store.spill.retries=5",
                              "store.host.threads=2", "train.eval.every=7", "train.eval.keep_best='auc'",
                              "train.optim.lr=0.02", "train.runtime.collective_timeout_s=60.0"])
    flat = tomllib.loads(dumps(job))
    for old, new in MOVED.items():  # the job as a recsys before the move saved it: every key flat
        section, group, key = new.split(".")
        flat[section][old.split(".")[1]] = flat[section][group].pop(key)
        if not flat[section][group]:
            del flat[section][group]
    text = tomli_w.dumps(flat)
    assert "spill_url" in text and "eval_every = 7" in text and "[store.spill]" not in text
    assert saved_job(text, "meta.json:config") == job
    with pytest.raises(ConfigError, match="store.spill_url: moved to store.spill.url"):  # as a job file: refused
        config.from_dict(JobConfig, tomllib.loads(text), "config.toml")
