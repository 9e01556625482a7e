"""The trainer: determinism, 2 ranks == 1 rank, exact resume, resharded resume, SIGTERM, CLI path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import wait_until
from dist_utils import run_distributed
from recsys.testing.harness import JOB, ROOT, losses

GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_losses.json"


def overrides(data: Path, *extra: str) -> list[str]:
    return [
        f"data.train.paths=['{data / 'train'}']",
        f"data.eval.paths=['{data / 'eval'}']",
        "data.train.batch_size=256",
        "data.eval.batch_size=1024",
        "train.log_every=1",
        "train.schedule.warmup_steps=0",
        "train.progress='none'",
        *extra,
    ]


def build(data: Path, run_dir: Path, *extra: str, resume=None, source=None):
    from recsys.config import load_job
    from recsys.train.loop import Trainer, setup_env

    job = load_job(JOB, overrides(data, *extra))
    env = setup_env("cpu")
    return Trainer(job, run_dir, env, resume=resume, source=source)


def run(data: Path, run_dir: Path, *extra: str, resume=None, source=None) -> dict:
    trainer = build(data, run_dir, *extra, resume=resume, source=source)
    try:
        return trainer.train()
    finally:
        trainer.close()


def final_rows(run_dir: Path) -> dict[str, dict[int, np.ndarray]]:
    from recsys.checkpoint import write as ckpt

    out = {}
    for name, table in ckpt.load_sparse(ckpt.latest(run_dir / "checkpoints")).items():
        emb = table.column("embedding").to_numpy(zero_copy_only=False)
        out[name] = dict(zip(table.column("key").to_pylist(), emb))
    return out


def assert_rows_close(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), f"table {name}: different keys"
        for k in a[name]:
            np.testing.assert_allclose(a[name][k], b[name][k], rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- a batch source


class ListSource:
    """The reader's interface over a fixed list of global batches; rank r gets slice r of each."""

    def __init__(self, batches, rank: int, world: int) -> None:
        self.batches, self.rank, self.world = batches, rank, world
        self.epoch, self.pos = 0, 0

    def __iter__(self):
        while self.pos < len(self.batches):
            batch = self.batches[self.pos]
            self.pos += 1
            yield slice_batch(batch, self.rank, self.world)
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]

    @staticmethod
    def merge_states(states):
        assert all(s == states[0] for s in states)
        return states[0]

    def close(self):
        pass


def slice_batch(batch, rank: int, world: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys.io.batch import Batch

    B = batch.size
    per = B // world
    lo, hi = rank * per, (rank + 1) * per
    vals, lens, wts = [], [], []
    for jt in batch.sparse.to_dict().values():
        o = jt.offsets()
        vals.append(jt.values()[o[lo] : o[hi]])
        lens.append(jt.lengths()[lo:hi])
        if jt.weights_or_none() is not None:
            wts.append(jt.weights()[o[lo] : o[hi]])
    kjt = KeyedJaggedTensor(keys=batch.sparse.keys(), values=torch.cat(vals), lengths=torch.cat(lens),
                            weights=torch.cat(wts) if wts else None)
    return Batch(batch.dense[lo:hi], batch.labels[lo:hi], kjt, {k: v[lo:hi] for k, v in batch.extra.items()},
                 None if batch.weights is None else batch.weights[lo:hi])


def global_batches(data: Path, size: int = 512, count: int = 8):
    from recsys.config import load_job
    from recsys.io.reader import ParquetReader

    job = load_job(JOB, overrides(data, f"data.train.batch_size={size}", "data.train.shuffle=false"))
    out = []
    with ParquetReader(job.data.train, job.schema) as reader:
        for batch in reader:
            if batch.size == size:
                out.append(batch)
            if len(out) == count:
                break
    return out


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("staleness", [0, 2])
def test_same_seed_same_loss_curve(tiny_data, tmp_path, staleness):
    extra = (f"store.staleness={staleness}", "train.max_steps=15")
    run(tiny_data, tmp_path / "a", *extra)
    run(tiny_data, tmp_path / "b", *extra)
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(la) == 15 and la == lb
    assert_rows_close(final_rows(tmp_path / "a"), final_rows(tmp_path / "b"), rtol=0, atol=0)


def test_staleness_changes_the_trajectory(tiny_data, tmp_path):
    # guards the test above: the schedule really differs between s = 0 and s = 2
    run(tiny_data, tmp_path / "s0", "train.max_steps=8")
    run(tiny_data, tmp_path / "s2", "store.staleness=2", "train.max_steps=8")
    l0, l2 = losses(tmp_path / "s0"), losses(tmp_path / "s2")
    assert l0[1] == l2[1]  # the first step sees no push either way
    assert l0[8] != l2[8]


def _two_rank_body(rank, world, data, run_dir, batches, *extra):
    from recsys.runtime.local_exchange import LocalExchange

    opened = []
    real_open = LocalExchange.open
    LocalExchange.open = classmethod(lambda cls, *a: opened.append(real_open(*a)) or opened[-1])
    try:
        run(data, Path(run_dir), "train.max_steps=8", *extra, source=ListSource(batches, rank, world))
    finally:
        LocalExchange.open = real_open
    return [x is not None for x in opened]


def test_two_ranks_equal_one_rank_at_staleness_zero(tiny_data, tmp_path):
    """Also: the exchange through shared memory (the default on one host) and through gloo
    train the same numbers, to the bit."""
    batches = global_batches(tiny_data)
    run(tiny_data, tmp_path / "one", "train.max_steps=8", source=ListSource(batches, 0, 1))
    shm = run_distributed(_two_rank_body, 2, tiny_data, str(tmp_path / "two"), batches)
    gloo = run_distributed(_two_rank_body, 2, tiny_data, str(tmp_path / "gloo"), batches, "train.runtime.local_exchange=false")
    # the store's channel and the trainer's (the control values, the dense gradients' mean)
    assert shm == [[True, True]] * 2 and gloo == [[]] * 2
    l1, l2, lg = losses(tmp_path / "one"), losses(tmp_path / "two"), losses(tmp_path / "gloo")
    assert sorted(l1) == sorted(l2) == list(range(1, 9))
    assert l2 == lg
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5)
    assert_rows_close(final_rows(tmp_path / "one"), final_rows(tmp_path / "two"))
    assert_rows_close(final_rows(tmp_path / "gloo"), final_rows(tmp_path / "two"), rtol=0, atol=0)


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_resume_equals_uninterrupted_run(tiny_data, tmp_path, staleness):
    """Exact at every staleness: a checkpoint is a synchronization point of the store (the
    look-ahead lookup is redone after it), so a resumed run sees the rows the full one saw."""
    # tiny has 23+ steps of 256 rows per epoch: the resume point is mid-epoch, mid-unit
    s = f"store.staleness={staleness}"
    run(tiny_data, tmp_path / "full", s, "train.max_steps=14", "train.checkpoint.every_steps=6", "train.checkpoint.keep_last=5")
    ckpt6 = tmp_path / "full" / "checkpoints" / "step-00000006"
    assert (ckpt6 / "meta.json").exists()
    run(tiny_data, tmp_path / "resumed", s, "train.max_steps=14", "train.checkpoint.every_steps=6", resume=ckpt6)
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(7, 15))
    assert {step: full[step] for step in resumed} == resumed
    assert_rows_close(final_rows(tmp_path / "full"), final_rows(tmp_path / "resumed"), rtol=0, atol=0)


def _save_two_body(rank, world, data, run_dir):
    return run(data, Path(run_dir), "train.max_steps=5")


def test_save_at_two_ranks_resume_at_one(tiny_data, tmp_path):
    from recsys.checkpoint import write as ckpt

    run_distributed(_save_two_body, 2, tiny_data, str(tmp_path / "two"))
    saved = ckpt.latest(tmp_path / "two" / "checkpoints")
    meta = ckpt.load_meta(saved)
    assert meta["world_size"] == 2 and meta["step"] == 5
    saved_rows = {n: t.num_rows for n, t in ckpt.load_sparse(saved).items()}
    trainer = build(tiny_data, tmp_path / "one", "train.max_steps=9", resume=saved)
    try:
        assert trainer.step == 5
        restored = {n: t.num_rows for n, t in trainer.store.state_dict().items()}
        assert restored == saved_rows
        result = trainer.train()
    finally:
        trainer.close()
    assert result["step"] == 9
    assert sorted(losses(tmp_path / "one")) == [6, 7, 8, 9]
    # the reader picked up where the two ranks left off: 5 steps × 2 ranks × 256 rows read
    state = ckpt.load_meta(saved)["reader"]
    assert sum(state["consumed"].values()) == 5 * 2 * 256


def test_sigterm_writes_a_checkpoint(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "recsys.train", "--config", str(JOB), "--run-dir", str(run_dir)]
    for o in overrides(tiny_data, "train.epochs=1000"):
        cmd += ["--set", o]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(losses(run_dir)) >= 3, 120, "3 logged steps")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    from recsys.checkpoint import write as ckpt

    latest = ckpt.latest(run_dir / "checkpoints")
    assert latest is not None and ckpt.load_meta(latest)["step"] >= 3
    assert json.loads((run_dir / "result.json").read_text())["stopped"] == "SIGTERM"


def test_golden_tiny_losses(tiny_data, tmp_path):
    """Pins the whole path (generator, reader, hashing, store, model, optimizers) on tiny.

    A deliberate change of any of them changes these losses: review the change, then
    rewrite the file with ``RECSYS_WRITE_GOLDEN=1 pytest tests/test_train.py -k golden``.
    """
    run(tiny_data, tmp_path / "g", "train.max_steps=10")
    got = losses(tmp_path / "g")
    if os.environ.get("RECSYS_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({str(k): v for k, v in got.items()}, indent=1) + "\n")
    want = {int(k): v for k, v in json.loads(GOLDEN.read_text()).items()}
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4), f"step {step}"


def test_dense_optimizer_implementations(tiny_data, tmp_path):
    """The default dense optimizer (torch's multi-tensor one) gives exactly the numbers of the
    per-tensor loop it replaced (the golden losses above were written with that loop), and
    ``train.optim.fused`` trains alike, the same every run, apart from the last float bits."""
    import copy

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.Linear(32, 1))
    params = {}
    for impl in ({"foreach": False}, {"foreach": True}):
        m = copy.deepcopy(net)
        opt = torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-4, **impl)
        g = torch.Generator().manual_seed(1)
        for _ in range(20):
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        params[str(impl)] = torch.cat([p.detach().flatten() for p in m.parameters()])
    assert torch.equal(*params.values())
    trainer = build(tiny_data, tmp_path / "probe", "train.max_steps=1")
    try:
        assert trainer.opt.defaults["foreach"] is True and not trainer.opt.defaults.get("fused")
    finally:
        trainer.close()
    run(tiny_data, tmp_path / "default", "train.max_steps=6")
    run(tiny_data, tmp_path / "fused", "train.max_steps=6", "train.optim.fused=true")
    run(tiny_data, tmp_path / "fused2", "train.max_steps=6", "train.optim.fused=true")
    default, fused = losses(tmp_path / "default"), losses(tmp_path / "fused")
    assert fused == losses(tmp_path / "fused2") and sorted(fused) == sorted(default)
    for step in default:
        assert fused[step] == pytest.approx(default[step], rel=1e-4)


def test_optimizer_threads_change_no_number(tiny_data, tmp_path):
    """``train.runtime.optimizer_threads`` runs the dense optimizer's step on that many torch threads
    and restores the count after; the step is elementwise, so the numbers are the same as with
    the trainer's own count (here checked on tensors large enough for torch to split)."""
    from recsys.train.config import RuntimeConfig
    from recsys.train.loop import torch_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(3)
        start = [torch.randn(600, 500, generator=g), torch.randn(70_000, generator=g)]
        grads = [[torch.randn(p.shape, generator=g) for p in start] for _ in range(5)]
        out = {}
        for n in (1, 2):
            params = [torch.nn.Parameter(p.clone()) for p in start]
            opt = torch.optim.Adam(params, lr=1e-2, weight_decay=1e-4, foreach=True)
            for step in grads:
                for p, gr in zip(params, step):
                    p.grad = gr.clone()
                with torch_threads(n):
                    assert torch.get_num_threads() == n
                    opt.step()
                assert torch.get_num_threads() == 2
            out[n] = torch.cat([p.detach().flatten() for p in params])
        assert torch.equal(out[1], out[2])
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="optimizer_threads"):
        RuntimeConfig(optimizer_threads=-1)
    run(tiny_data, tmp_path / "one", "train.max_steps=6", "train.runtime.threads=2")
    run(tiny_data, tmp_path / "same", "train.max_steps=6", "train.runtime.threads=2", "train.runtime.optimizer_threads=0")
    assert losses(tmp_path / "one") == losses(tmp_path / "same")


@pytest.mark.slow  # make test-slow, in CI: keeps make test under 20 minutes
def test_cli_train_two_processes_then_eval(tiny_data, tmp_path):
    run_dir = tmp_path / "cli"
    recsys = [sys.executable, "-m", "recsys.cli"]
    cmd = [*recsys, "train", "--config", str(JOB), "--nproc", "2", "--run-dir", str(run_dir)]
    for o in overrides(tiny_data, "train.log_every=5"):
        cmd += ["--set", o]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"run directory: {run_dir}" in out.stdout
    trained = json.loads((run_dir / "result.json").read_text())
    out = subprocess.run([*recsys, "eval", "--checkpoint", str(run_dir), "--json", str(tmp_path / "e.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    evaluated = json.loads((tmp_path / "e.json").read_text())
    assert evaluated["rows"] == trained["rows"] == 2000
    assert evaluated["auc"] == pytest.approx(trained["auc"], abs=1e-6)
    assert evaluated["log_loss"] == pytest.approx(trained["log_loss"], rel=1e-5)
