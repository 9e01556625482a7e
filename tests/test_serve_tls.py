"""A Redis with a password and TLS (rediss://): export and serve take both from the URL, and
no message ever shows the password."""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest

from conftest import start_redis
from embedding_server import publish
from embedding_server.app import create_app
from embedding_server.settings import ServeSettings
from serving_data import LiveServer

pytestmark = pytest.mark.redis
PASSWORD = "pa55-w0rd-not-in-logs"


@pytest.fixture
def tls_redis(tmp_path):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test's certificate (Debian: apt-get install -y openssl)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = start_redis(tmp_path / "redis", "--requirepass", PASSWORD, "--tls-cert-file", str(cert),
                         "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
                         "--tls-replication", "no", tls_port=True)
    yield server, f"rediss://:{{password}}@127.0.0.1:{server.port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
    server.stop()


def test_export_and_serve_over_tls_with_a_password(tiny_run, tls_redis):
    server, template = tls_redis
    url = template.format(password=PASSWORD)
    summary = publish.export(tiny_run, url, publish.ExportSettings(version="tls"), progress=False)
    assert summary["rows"] > 1000
    with LiveServer(create_app(ServeSettings(redis=url))) as live:
        r = httpx.post(live.url + "/v1/lookup", json={"feature": "c1", "ids": [1, 2]})
        assert r.status_code == 200 and r.json()["version"] == "tls"
        ready = httpx.get(live.url + "/readyz").json()
        assert PASSWORD not in ready["detail"] and ":***@" in ready["detail"]


def test_wrong_password_is_one_line_without_the_password(tiny_run, tls_redis):
    server, template = tls_redis
    wrong = template.format(password="wrong-" + PASSWORD)
    out = subprocess.run([sys.executable, "-m", "recsys.cli", "export", "--checkpoint", str(tiny_run), "--redis",
                          wrong, "--no-progress"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert PASSWORD not in out.stderr + out.stdout and ":***@" in out.stderr
    with LiveServer(create_app(ServeSettings(redis=wrong))) as live:
        r = httpx.post(live.url + "/v1/lookup", json={"feature": "c1", "ids": [1]})
        assert r.status_code == 503 and PASSWORD not in r.text
        assert httpx.get(live.url + "/readyz").status_code == 503
