"""Every store, lookup and table implementation has the contract ``recsys.store.protocols``
declares: each method, with the declared parameters in order (an implementation may add
keyword parameters with defaults), and each attribute on a live instance."""

from __future__ import annotations

import inspect

import pytest

from recsys.store import protocols
from recsys.store.config import DeviceConfig, StoreConfig
from recsys.store.device.cache import DeviceCache
from recsys.store.device.table import DeviceTable
from recsys.store.sharded.store import Lookup, ShardedEmbeddingStore
from recsys.store.tables.table import EmbeddingTable
from recsys.store.tables.wide import PairLookup, WideStore, wide_schema
from store_data import random_kjts, three_feature_schema

IMPLEMENTATIONS = [
    (protocols.EmbeddingStore, ShardedEmbeddingStore),
    (protocols.EmbeddingStore, WideStore),
    (protocols.StoreLookup, Lookup),
    (protocols.StoreLookup, PairLookup),
    (protocols.Table, EmbeddingTable),
    (protocols.Table, DeviceCache),
    (protocols.Table, DeviceTable),
]


def _methods(proto) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(proto).items()
            if callable(fn) and (not name.startswith("_") or name == "__len__")}


@pytest.mark.parametrize("proto,cls", IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_each_implementation_has_every_declared_method_with_its_parameters(proto, cls):
    declared = _methods(proto)
    assert declared, proto
    for name, sig in declared.items():
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks {name}()"
        want = [p for p in sig.parameters.values() if p.name != "self"]
        have = [p for p in inspect.signature(impl).parameters.values() if p.name != "self"]
        assert [p.name for p in have[: len(want)]] == [p.name for p in want], (cls.__name__, name)
        extra = have[len(want):]
        assert all(p.default is not inspect.Parameter.empty for p in extra), (cls.__name__, name, extra)


def test_live_instances_satisfy_the_protocols():
    """``isinstance`` against a runtime-checkable protocol checks every member, attributes too."""
    schema = three_feature_schema(4, 100)
    cfg = StoreConfig(device=DeviceConfig(cache_rows=20))
    deep = ShardedEmbeddingStore(schema, cfg)
    wide = WideStore(ShardedEmbeddingStore(schema, StoreConfig()), ShardedEmbeddingStore(wide_schema(schema),
                                                                                         StoreConfig()))
    try:
        kjt = random_kjts(1, vocab=10, seed=0)[0]
        for store in (deep, wide):
            assert isinstance(store, protocols.EmbeddingStore)
            lookup = store.lookup(kjt, None, train=False)
            assert isinstance(lookup, protocols.StoreLookup)
        assert all(isinstance(t, protocols.Table) for t in deep.tables.values())
        assert all(isinstance(t, DeviceCache) for t in deep.tables.values())
        assert isinstance(deep.tables["user"].host, protocols.Table)
        assert not isinstance(object(), protocols.Table)  # the check can fail
        whole = ShardedEmbeddingStore(schema, StoreConfig(device=DeviceConfig(cache_rows=100)))  # holds each table whole
        assert all(isinstance(t, DeviceTable) and isinstance(t, protocols.Table) for t in whole.tables.values())
        whole.close()
    finally:
        deep.close()
        wide.close()
