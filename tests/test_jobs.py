"""Every shipped job file loads, and its data paths point inside data/."""

from pathlib import Path

import pytest

from recsys.config import load_job

JOBS = sorted((Path(__file__).resolve().parent.parent / "jobs").glob("*.toml"))


def test_there_are_job_files():
    assert JOBS, "jobs/ holds no job files"


@pytest.mark.parametrize("path", JOBS, ids=[p.stem for p in JOBS])
def test_job_loads(path):
    job = load_job(path)
    assert job.schema.sparse, f"{path.name} declares no sparse features"
    assert job.data.train.paths, f"{path.name} has no training data paths"
