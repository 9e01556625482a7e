"""A Redis with a password and TLS (rediss://): export and serve take both from the URL, and
no message ever shows the password. The service itself over HTTPS (``--ssl-certfile``,
``--ssl-keyfile``): a bearer token never travels in clear off loopback."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys

import httpx
import pytest

from embedding_server import export as publish
from embedding_server.app import create_app, uvicorn_tls
from embedding_server.settings import ServeSettings
from recsys.testing.harness import start_redis
from serving_data import LiveServer

pytestmark = pytest.mark.redis
PASSWORD = "pa55-w0rd-not-in-logs"


def self_signed(tmp_path):
    """Return (certificate, key) PEM files of a self-signed certificate for 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test's certificate (Debian: apt-get install -y openssl)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture
def tls_redis(tmp_path):
    cert, key = self_signed(tmp_path)
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


# ------------------------------------------------------------------ the service over HTTPS


def test_service_over_https_with_a_token(tiny_run, tmp_path):
    cert, key = self_signed(tmp_path)
    token = tmp_path / "token"
    token.write_text("tls-token\n")
    settings = ServeSettings(checkpoint=str(tiny_run), token_file=str(token), ssl_certfile=str(cert),
                             ssl_keyfile=str(key))
    assert settings.scheme == "https"
    with LiveServer(create_app(settings), tls=uvicorn_tls(settings)) as live:
        assert live.url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=30) as client:
            r = client.post(live.url + "/v1/lookup", json={"feature": "c1", "ids": [1]},
                            headers={"authorization": "Bearer tls-token"})
            assert r.status_code == 200 and r.url.scheme == "https" and len(r.json()["found"]) == 1
        with httpx.Client(timeout=30) as plain, pytest.raises(httpx.TransportError):
            plain.get(f"http://127.0.0.1:{live.port}/healthz")  # no clear-text HTTP on the TLS port


def test_a_token_off_loopback_needs_tls(tiny_run, tmp_path):
    cert, key = self_signed(tmp_path)
    token = tmp_path / "token"
    token.write_text("tls-token\n")
    base = dict(checkpoint=str(tiny_run), token_file=str(token))
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.internal"):
        with pytest.raises(ValueError, match="needs ssl_certfile and ssl_keyfile.*must not travel in clear"):
            ServeSettings(host=host, **base)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert ServeSettings(host=host, **base).scheme == "http"
    assert ServeSettings(host="0.0.0.0", ssl_certfile=str(cert), ssl_keyfile=str(key), **base).scheme == "https"
    assert ServeSettings(host="0.0.0.0", checkpoint=str(tiny_run)).scheme == "http"  # no token: nothing to leak
    with pytest.raises(ValueError, match="go together"):
        ServeSettings(ssl_certfile=str(cert), **base)
    with pytest.raises(ValueError, match="ssl_keyfile .*missing.pem: not a file"):
        ServeSettings(ssl_certfile=str(cert), ssl_keyfile=str(tmp_path / "missing.pem"), **base)
    out = subprocess.run([sys.executable, "-m", "recsys.cli", "serve", "--checkpoint", str(tiny_run), "--host",
                          "0.0.0.0", "--token-file", str(token)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--ssl-certfile" in out.stderr and "Traceback" not in out.stderr
