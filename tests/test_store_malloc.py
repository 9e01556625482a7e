"""``recsys.store.host.malloc``: freed memory is reused instead of faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = r"""
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from recsys.store.host.malloc import keep_freed_memory
    assert keep_freed_memory()
faults = []
for _ in range(6):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(24 << 18, dtype=np.float32)  # 24 MiB, like a step's pooled embeddings
    a.fill(1.0)
    del a
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(sum(faults[1:]))
"""


def _faults_after_first(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_is_reused_without_page_faults():
    kept = _faults_after_first("keep")
    default = _faults_after_first("default")
    assert kept <= 5, kept  # the freed 24 MiB came back from malloc's arena, already backed
    assert default > kept, (default, kept)  # glibc's defaults hand it back to the kernel each time


def test_a_store_sets_it_unless_told_not_to(monkeypatch):
    from recsys.features.schema import FeatureSpec, Schema, TableSpec
    from recsys.store.sharded import store as sharded
    from recsys.store.config import HostConfig, StoreConfig

    calls = []
    monkeypatch.setattr(sharded, "keep_freed_memory", lambda: calls.append(1))
    schema = Schema(tables={"t": TableSpec(dim=4, capacity=16)}, sparse=[FeatureSpec(name="f", table="t")])
    sharded.ShardedEmbeddingStore(schema, StoreConfig(host=HostConfig(keep_freed_memory=False))).close()
    assert calls == []
    sharded.ShardedEmbeddingStore(schema, StoreConfig()).close()
    assert calls == [1]
