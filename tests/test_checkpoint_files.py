"""Every command resolves a checkpoint the same way, from any of the paths a user holds."""

import json

import pytest

from recsys import checkpoint_files as cf


def _fake_run(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for step in (100, 200):
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"format_version": cf.FORMAT_VERSION, "step": step}))
    (root / "latest").write_text("step-00000200\n")
    return tmp_path / "run"


def test_resolve_accepts_every_form(tmp_path):
    run = _fake_run(tmp_path)
    newest = run / "checkpoints" / "step-00000200"
    assert cf.resolve(run) == newest
    assert cf.resolve(run / "checkpoints") == newest
    assert cf.resolve(run / "checkpoints" / "latest") == newest
    older = run / "checkpoints" / "step-00000100"
    assert cf.resolve(older) == older
    assert cf.load_meta(cf.resolve(run / "checkpoints" / "latest"))["step"] == 200


def test_resolve_errors_name_the_path_and_the_forms(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        cf.resolve(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="expected a step directory"):
        cf.resolve(tmp_path / "empty")
    run = _fake_run(tmp_path)
    (run / "checkpoints" / "latest").write_text("step-00000300\n")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        cf.resolve(run)
