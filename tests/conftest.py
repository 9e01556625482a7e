"""Shared fixtures: a real redis-server on a free port, the tiny data set and a run of it.

Starting processes and servers, waiting and reading a run's records: ``recsys/testing/harness.py``,
which the benchmarks use too."""

from __future__ import annotations

import pytest

from recsys.testing.harness import start_redis, wait_for


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """``recsys.testing.harness.wait_for``, polling every 20 ms unless told."""
    return wait_for(predicate, timeout, what, interval)


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server for one test; stopped afterwards."""
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """The tiny synthetic data set (seed 0), generated once per session; tests only read it."""
    from recsys.io import synth

    out = tmp_path_factory.mktemp("tiny")
    synth.generate("tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A run directory trained on the tiny synthetic set (1 process, staleness 0)."""
    from serving_data import train_tiny

    return train_tiny(tmp_path_factory.mktemp("tiny_run"))


def pytest_collection_modifyitems(config, items):
    """Skip the ``cuda``-marked tests where torch sees no GPU (this machine, CI)."""
    cuda = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda:
        return
    import torch

    if torch.cuda.is_available():
        return
    why = "no CUDA GPU visible" if torch.version.cuda else "torch built without CUDA"
    for item in cuda:
        item.add_marker(pytest.mark.skip(reason=f"cuda: {why}"))
