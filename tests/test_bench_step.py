"""``recsys bench step`` (recsys/bench/step.py): the op counter counts a known op sequence
exactly and flags the ops that force a host sync on CUDA (not their static equivalents),
the meta timer runs a static step and refuses a data-dependent one, and the bench runs end
to end on the tiny set, arm (2) through a stand-in of the device key map's API and, on its
own, with the real one. No timings asserted."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from recsys.bench import step as bench_step
from recsys.bench.step import OpCounter, meta_time
from recsys.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY_JOB = str(ROOT / "jobs" / "synthetic_tiny.toml")


def _counted(fn) -> OpCounter:
    counter = OpCounter()
    with counter:
        fn()
    return counter


def test_counts_a_known_sequence_exactly():
    x = torch.arange(6.0)
    idx = torch.tensor([0, 1])

    def region():
        y = x.view(2, 3).t()
        z = (y + 1).sum(dim=0)
        z.index_select(0, idx)
        x.numpy()
        torch.from_numpy(idx.numpy().copy()).to("cpu")

    c = _counted(region).counts
    # a tensor read by numpy is detached first, an array made a tensor is lifted: both views
    assert dict(c.view) == {"aten.view.default": 1, "aten.t.default": 1, "aten.detach.default": 2,
                            "aten.lift_fresh.default": 1}
    assert dict(c.compute) == {"aten.add.Tensor": 1, "aten.sum.dim_IntList": 1, "aten.index_select.default": 1}
    assert not c.sync
    assert sum(c.to_host.values()) == 2 and all(k.startswith("Tensor.numpy @ ") for k in c.to_host)
    assert list(c.from_host.values()) == [1] and sum(c.uploads.values()) == 1
    assert c.per_step(1)["ops"] == 8 and c.per_step(1)["sync_forcing"] == 0
    # the patched entry points are restored on exit
    assert torch.Tensor.numpy is torch._C.TensorBase.numpy and "numpy" not in torch.Tensor.__dict__


SYNCING = {
    "item": (lambda x, m, i: x.sum().item(), "aten._local_scalar_dense.default"),
    "nonzero": (lambda x, m, i: torch.nonzero(m), "aten.nonzero.default"),
    "unique": (lambda x, m, i: torch.unique(i), "aten._unique2.default"),
    "bool mask read": (lambda x, m, i: x[m], "aten.index.Tensor"),
    "bool mask write": (lambda x, m, i: x.clone().__setitem__(m, 0.0), "aten.index_put_.default"),
    "masked_select": (lambda x, m, i: torch.masked_select(x, m), "aten.masked_select.default"),
    "repeat_interleave": (lambda x, m, i: torch.repeat_interleave(i), "aten.repeat_interleave.Tensor"),
    "equal": (lambda x, m, i: torch.equal(x, x), "aten.equal.default"),
}


@pytest.mark.parametrize("case", sorted(SYNCING))
def test_flags_sync_forcing_ops(case):
    fn, op = SYNCING[case]
    x, m, i = torch.arange(6.0), torch.arange(6) > 2, torch.tensor([1, 2, 2])
    c = _counted(lambda: fn(x, m, i)).counts
    assert c.sync[op] == 1, dict(c.sync)


STATIC = {  # the static-shape equivalents of the cases above: no sync on CUDA
    "sum kept on device": lambda x, m, i: x.sum(),
    "where instead of a mask": lambda x, m, i: torch.where(m, x, 0.0),
    "long index read": lambda x, m, i: x[i],
    "long index write": lambda x, m, i: x.clone().index_put_((i,), torch.ones(3)),
    "sort and flags instead of unique": lambda x, m, i: torch.sort(i).values.diff(prepend=i[:1] - 1) != 0,
    "repeat_interleave with output_size": lambda x, m, i: torch.repeat_interleave(i, output_size=5),
    "cumsum": lambda x, m, i: torch.cumsum(m, 0),
}


@pytest.mark.parametrize("case", sorted(STATIC))
def test_does_not_flag_static_equivalents(case):
    x, m, i = torch.arange(6.0), torch.arange(6) > 2, torch.tensor([1, 2, 2])
    c = _counted(lambda: STATIC[case](x, m, i)).counts
    assert not c.sync and sum(c.compute.values()) >= 1, (dict(c.sync), dict(c.compute))


def _static_step(device):
    w = torch.randn(32, 8, device=device, requires_grad=True)
    idx = torch.arange(16, device=device) % 32

    def step(i):
        torch.nn.functional.embedding(idx, w).sum().backward()
        with torch.no_grad():
            w.sub_(0.1 * w.grad)
        w.grad = None

    return step


def test_meta_timer_runs_a_static_step():
    t = meta_time(_static_step, steps=3, warmup=1)
    assert t.ran and t.data_dependent == 0 and len(t.per_step_ms) == 3 and t.host_ms_per_step > 0


@pytest.mark.parametrize("op", ["nonzero", "unique", "mask"])
def test_meta_timer_refuses_a_data_dependent_step(op):
    def make(device):
        x = torch.arange(8.0, device=device)
        fns = {"nonzero": lambda: torch.nonzero(x), "unique": lambda: torch.unique(x), "mask": lambda: x[x > 3]}
        return lambda i: fns[op]()

    t = meta_time(make, steps=3)
    assert not t.ran and t.host_ms_per_step is None
    assert t.reason.startswith("not launch-bound-measurable")


class _StandInSparse:
    """A stand-in with ``DeviceSparse``'s API (static shapes: ids folded by remainder)."""

    ROWS = 64

    def __init__(self, tables, features, cfg, device):
        self.F = len(features)
        self.D = next(iter(tables.values())).dim
        self.w = torch.zeros(self.ROWS, self.D, device=device, requires_grad=True)

    def forward(self, keys, lengths, step, weights=None):
        B = lengths.shape[0] // self.F
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        bags = torch.nn.functional.embedding_bag(keys.remainder(self.ROWS), self.w, offsets, mode="sum",
                                                 include_last_offset=True, per_sample_weights=weights)
        return bags.view(self.F, B, self.D).transpose(0, 1)

    def update(self, step):
        with torch.no_grad():
            self.w.sub_(0.01 * self.w.grad)
        self.w.grad = None

    def counters(self):
        return {}


def test_bench_step_quick_end_to_end(tmp_path, monkeypatch, capsys, tiny_data):
    module = types.ModuleType("stand_in_keymap")
    module.DeviceSparse = _StandInSparse
    monkeypatch.setitem(sys.modules, "stand_in_keymap", module)
    monkeypatch.setattr(bench_step, "KEYMAP_MODULE", "stand_in_keymap")
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--quick", "--data", str(tiny_data), "--config", TINY_JOB, "--batch-size", "256",
                 "--steps", "2", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["target"] == "step" and saved["settings"]["batch_size"] == 256 and saved["settings"]["steps"] == 2
    arms = saved["arms"]
    assert set(arms) == {"whole_device", "keymap", "keymap_cached", "whole_device_doubled", "keymap_doubled",
                         "keymap_cached_doubled"}
    for name, arm in arms.items():
        p = arm["per_step"]
        assert p["ops"] == p["compute"] + p["view"] + p["sync_forcing"] > 0, name
        assert arm["cpu_ms_per_step"] > 0 and p["in_ops_ms"] > 0
        assert arm["tables"] == 28 * (2 if name.endswith("doubled") else 1)
    whole = arms["whole_device"]
    assert whole["per_step"]["from_host"] > 0  # the host's key work hands slots to torch every step
    assert arms["whole_device_doubled"]["per_step"]["ops"] > whole["per_step"]["ops"]
    meta = whole["meta"]
    assert meta["ran"] or meta["reason"].startswith("not launch-bound-measurable")
    # the stand-in is all static: it runs on meta, its ops do not grow with the tables, no syncs
    keymap = arms["keymap"]
    assert keymap["meta"]["ran"] and keymap["meta"]["host_ms_per_step"] > 0
    assert keymap["per_step"]["sync_forcing"] == 0
    assert arms["keymap_doubled"]["per_step"]["ops"] == keymap["per_step"]["ops"]
    cached = arms["keymap_cached"]  # the real DeviceCachedSparse: it reads the device every step
    assert cached["per_step"]["to_host"] >= 1 and cached["per_step"]["from_host"] >= 1 and "meta" not in cached
    assert {c["name"] for c in saved["comparisons"]} >= {"CPU steps/s, key map vs whole-device",
                                                        "CPU steps/s, cached key map (10 % cache) vs key map"}
    # the dispatch floor: both arms at 8 rows a step and tables of at most 256 rows, the
    # same code (the static stand-in: the same ops as at full size)
    floor = saved["floor"]
    assert set(floor) == {"whole_device", "keymap"}
    assert floor["keymap"]["per_step"]["ops"] == keymap["per_step"]["ops"]
    assert all(arm["cpu_ms_per_step"] > 0 for arm in floor.values())
    printed = capsys.readouterr().out
    assert "dispatch floor, keymap (B 8, tables <= 256 rows)" in printed
    assert "recsys bench step --quick" in printed and "SIMD" in printed and "whole_device (28 tables)" in printed


def test_keymap_arm_fails_when_the_device_counted_an_error(monkeypatch):
    """The arm's close reads ``counters()``: an error there fails the arm (no figures from a
    corrupt index)."""

    class Corrupt(_StandInSparse):
        def counters(self):
            raise RuntimeError("new keys found no free way in their two buckets (1 buckets)")

    module = types.ModuleType("corrupt_keymap")
    module.DeviceSparse = Corrupt
    monkeypatch.setitem(sys.modules, "corrupt_keymap", module)
    monkeypatch.setattr(bench_step, "KEYMAP_MODULE", "corrupt_keymap")
    schema = types.SimpleNamespace(tables={"t": types.SimpleNamespace(dim=2)},
                                   sparse=[types.SimpleNamespace(name="f", table="t", pooling="sum")])
    _, close = bench_step.keymap_step(schema, None, [])(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="keymap arm.*no free way"):
        close()


def test_keymap_arm_runs_the_device_key_map_on_meta(tiny_data):
    """Arm (2) with the real ``DeviceSparse`` on the tiny set: no sync-forcing op, the same
    ops per step with every table doubled, and a host time per step on meta (its one host
    read, the LRU order's first sort, skipped there)."""
    s = bench_step.Settings(batch_size=256, steps=2, warmup=2, job=TINY_JOB, doubled=False)
    job = bench_step.load_step_job(tiny_data, s, "store.device.memory_gb=1.0", "store.device.cache_rows=0")
    batches = bench_step.read_batches(job, s.batches)
    arms = {}
    for name, schema, kjts in (("base", job.schema, batches),
                               ("doubled", bench_step.doubled(job.schema), [bench_step.doubled_kjt(k) for k in batches])):
        arms[name] = bench_step.run_arm(bench_step.keymap_step(schema, job.store, kjts), s)
    for arm in arms.values():
        assert arm["per_step"]["sync_forcing"] == 0 and arm["per_step"]["to_host"] == 0
        assert arm["meta"]["ran"] and arm["meta"]["host_ms_per_step"] > 0, arm["meta"]
    base, twice = arms["base"]["per_step"]["ops"], arms["doubled"]["per_step"]["ops"]
    assert twice <= 1.1 * base, (base, twice)
    # at the dispatch floor (8 rows a step, small tables: every step evicts) no sync either
    floor = bench_step.dispatch_floor(tiny_data, s, with_keymap=True)
    assert floor["keymap"]["per_step"]["sync_forcing"] == 0 and floor["keymap"]["per_step"]["to_host"] == 0
    assert floor["whole_device"]["per_step"]["from_host"] > 0  # the host's key work, even at 64 rows


def test_keymap_arm_skipped_when_absent(monkeypatch):
    monkeypatch.setattr(bench_step, "KEYMAP_MODULE", "recsys.store.device.no_such_keymap")
    assert "cannot be imported" in bench_step.keymap_available()


def test_step_options_are_for_bench_step_only(capsys):
    assert main(["bench", "store", "--steps", "3"]) == 2
    assert "for `recsys bench step` only" in capsys.readouterr().err
