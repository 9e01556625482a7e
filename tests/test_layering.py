"""Layers point one way: light modules stay torch-free, models never see the store."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


def test_model_never_imports_store_or_io():
    bad = {n for n in _imports("recsys/model") if n.startswith(("recsys.store", "recsys.io", "recsys.train"))}
    assert not bad, f"recsys.model imports {sorted(bad)}"


def test_embedding_server_never_imports_torch():
    bad = {n for n in _imports("embedding_server") if n.split(".")[0] in {"torch", "torchrec", "fbgemm_gpu"}}
    assert not bad, f"embedding_server imports {sorted(bad)}"


def test_package_import_is_light():
    code = "import sys, recsys, recsys.cli, recsys.config; print(sorted(m for m in ('torch', 'torchrec', 'pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_embedding_server_runs_without_torch(tiny_run):
    """Import every module of the service and serve a lookup from a checkpoint: no torch loads."""
    modules = sorted(p.stem for p in (ROOT / "embedding_server").glob("*.py") if p.stem != "__init__")
    code = f"""
import asyncio, importlib, sys
for name in {modules!r}:
    importlib.import_module("embedding_server." + name)
from embedding_server.backends import EmbeddedBackend
backend = EmbeddedBackend({str(tiny_run)!r})
snap = asyncio.run(backend.snapshot())
keys = snap.catalog.keys(snap.catalog.feature("c3"), ["a", "b"])
asyncio.run(backend.rows(snap, [("c3", keys)]))
from embedding_server.app import create_app
from embedding_server.settings import ServeSettings
create_app(ServeSettings(checkpoint={str(tiny_run)!r}))
import recsys.cli
print(sorted(m for m in ("torch", "torchrec", "fbgemm_gpu") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
