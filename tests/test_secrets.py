"""Secrets: no Redis password on disk or in a message.

- ``redact`` (messages, logs) hides every credential form redis-py accepts; ``strip_password``
  (what is saved) drops them and keeps everything else redis-py reads.
- A job's ``config.toml`` and checkpoints keep its Redis URLs without the password; a resumed
  run takes it from ``*_password_file`` or ``$REDIS_PASSWORD`` and connects (a real
  redis-server with ``--requirepass``), as does ``recsys serve``.
- The messages that showed a raw URL (a bad store.spill.url scheme, an unreadable live manifest
  and the takeover warning) show it redacted.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from redis.connection import parse_url

from recsys.testing.harness import start_redis
from recsys.redisio.client import (PASSWORD_ENV, check_url, client_options, has_password, password_for, redact,
                               redact_text, strip_password)
from serving_data import JOB, LiveServer

PASSWORD = "s3cr3t-Pa55"
SECRET_FORMS = [  # (url with the password, what redact keeps of it)
    (f"redis://:{PASSWORD}@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    (f"redis://alice:{PASSWORD}@cache.internal:6380/2", "redis://alice:***@cache.internal:6380/2"),
    (f"rediss://alice:{PASSWORD}@[::1]:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem",
     "rediss://alice:***@[::1]:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"),
    (f"unix://:{PASSWORD}@/run/redis.sock?db=3", "unix://:***@/run/redis.sock?db=3"),
    (f"unix:///run/redis.sock?db=3&password={PASSWORD}", "unix:///run/redis.sock?db=3&password=***"),
    (f"redis://cache:6379/0?username=alice&password={PASSWORD}", "redis://cache:6379/0?username=alice&password=***"),
    (f"rediss://cache/0?ssl_password={PASSWORD}&ssl_keyfile=/k.pem", "rediss://cache/0?ssl_password=***&ssl_keyfile=/k.pem"),
    (f"redis://:{PASSWORD}@cache/0#{PASSWORD}", "redis://:***@cache/0#***"),
    (f"redis://:p%40{PASSWORD}%23x@cache:1/0", "redis://:***@cache:1/0"),  # percent-encoded '@' and '#'
]
PLAIN = ["redis://127.0.0.1:6379/0", "rediss://alice@cache:6380/0?ssl_cert_reqs=none", "unix:///run/redis.sock?db=1",
         "redis://cache/0?username=alice", "redis://[::1]:6379"]


# ------------------------------------------------------------------ the one redaction


@pytest.mark.parametrize("url, shown", SECRET_FORMS)
def test_redact_hides_every_password_form_redis_py_reads(url, shown):
    options = parse_url(url)
    assert PASSWORD in str(options.get("password", "")) + str(options.get("ssl_password", ""))
    assert redact(url) == shown and PASSWORD not in redact(url)
    assert redact_text(f"Redis at {url} failed; retry {url!r}") == f"Redis at {shown} failed; retry {shown!r}"
    saved = strip_password(url)
    assert PASSWORD not in saved and "***" not in saved and has_password(url) and not has_password(saved)
    kept = parse_url(saved)  # everything redis-py reads but the password is still there
    assert kept == {k: v for k, v in options.items() if k not in ("password", "ssl_password")}


@pytest.mark.parametrize("url", PLAIN)
def test_urls_without_a_password_are_unchanged(url):
    assert redact(url) == strip_password(url) == url and not has_password(url)


@pytest.mark.parametrize("url", [f"redis://:{PASSWORD[:4]}#{PASSWORD[4:]}@cache:6379/0",
                                 f"redis://:{PASSWORD[:4]}?{PASSWORD[4:]}@cache/0",
                                 f"redis://:{PASSWORD}@[::1/0"])
def test_an_unparsable_url_shows_nothing_of_its_password(url):
    """An unquoted '#' or '?' cuts the password in two (an ambiguous URL: masked up to its
    last '@'); an unclosed '[' is unparsable (masked whole)."""
    assert redact(url) in ("<unparsable url>", "redis://***@cache:6379/0", "redis://***@cache/0")
    with pytest.raises(ValueError, match="store.spill.url: (not a valid|ambiguous) Redis URL") as err:
        check_url(url, "store.spill.url")
    assert PASSWORD[:4] not in str(err.value) and PASSWORD[4:] not in str(err.value)


def test_a_bad_spill_scheme_is_named_without_the_password():
    from recsys.store.config import SpillConfig

    with pytest.raises(ValueError, match="store.spill.url") as err:
        SpillConfig(url=f"http://:{PASSWORD}@cache:6379/0")
    assert PASSWORD not in str(err.value) and "http://:***@cache:6379/0" in str(err.value)


def test_user_errors_redact_any_url_they_quote():
    from recsys.config import ConfigError, JobConfig, apply_overrides
    from recsys.errors import user_message

    with pytest.raises(ConfigError) as err:  # a typo in the key: the message quotes the whole override
        apply_overrides({}, [f"store.spil_url='redis://:{PASSWORD}@cache:6379/0'"], JobConfig)
    message = user_message(err.value)
    assert "spil_url" in message and PASSWORD not in message and "redis://:***@cache:6379/0" in message


# ------------------------------------------------------------------ where the password comes from


def test_password_sources_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    (tmp_path / "pw").write_text("from-file\n")
    url = "redis://cache:6379/0"
    assert password_for("redis://:from-url@cache:6379/0", str(tmp_path / "pw")) is None  # the URL's own wins
    assert password_for(url, str(tmp_path / "pw")) == "from-file"
    assert client_options(url, str(tmp_path / "pw")) == {"password": "from-file"}
    assert password_for(url) == "from-env" and client_options(url) == {"password": "from-env"}
    monkeypatch.delenv(PASSWORD_ENV)
    assert password_for(url) is None and client_options(url) == {}
    with pytest.raises(ValueError, match=r"store.spill.password_file: cannot read the Redis password file .*nope"):
        password_for(url, str(tmp_path / "nope"), "store.spill.password_file")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="publish.redis_password_file: .*empty must hold one non-empty line"):
        password_for(url, str(tmp_path / "empty"), "publish.redis_password_file")


def test_a_saved_job_holds_no_password(tmp_path):
    from recsys.config import JobConfig, dumps, from_dict, write_resolved
    from recsys.store.config import SpillConfig, StoreConfig
    from recsys.train.config import PublishConfig

    job = JobConfig(store=StoreConfig(spill=SpillConfig(url=f"redis://:{PASSWORD}@cache:6379/0")),
                    publish=PublishConfig(redis=f"rediss://alice:{PASSWORD}@cache:6380/1?ssl_ca_certs=/ca.pem"))
    text = dumps(job)
    path = write_resolved(job, tmp_path)
    for saved in (text, path.read_text()):
        assert PASSWORD not in saved
        assert '[store.spill]\nurl = "redis://cache:6379/0"' in saved
        assert 'redis = "rediss://alice@cache:6380/1?ssl_ca_certs=/ca.pem"' in saved
    import tomllib

    again = from_dict(JobConfig, tomllib.loads(text))  # still a job file
    assert again.store.spill.url == "redis://cache:6379/0" and job.store.spill.url.endswith("@cache:6379/0")


# ------------------------------------------------------------------ with a real password-protected Redis


@pytest.fixture
def locked_redis(tmp_path):
    server = start_redis(tmp_path / "redis", "--requirepass", PASSWORD)
    yield server
    server.stop()


def _client(server):
    import redis

    return redis.Redis(host=server.host, port=server.port, password=PASSWORD)


@pytest.mark.redis
def test_an_unreadable_live_manifest_is_named_without_the_password(locked_redis, caplog):
    from recsys.redisio.live import manifest_key
    from recsys.train.config import PublishConfig
    from recsys.train.live_writer import LiveWriter
    from recsys.errors import UserError
    from recsys.train.live_push import claim

    url = f"redis://:{PASSWORD}@{locked_redis.host}:{locked_redis.port}/0"
    client = _client(locked_redis)
    client.set(manifest_key("live"), b"not json")
    with pytest.raises(ValueError) as err:
        LiveWriter(url, "live").read_manifest()
    assert PASSWORD not in str(err.value) and ":***@" in str(err.value)
    manifest = {"run": "this-run"}
    with pytest.raises(UserError) as err:
        claim(PublishConfig(redis=url), manifest)
    assert "unreadable manifest" in str(err.value) and PASSWORD not in str(err.value)
    with caplog.at_level(logging.WARNING, logger="recsys.train.live_push"):
        assert claim(PublishConfig(redis=url, takeover=True), manifest)
    assert "took over" in caplog.text and "unreadable manifest" in caplog.text and PASSWORD not in caplog.text
    assert json.loads(client.get(manifest_key("live")))["run"] == "this-run"
    client.close()


def _train(run_dir: Path, config: Path, env: dict, *sets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(config), "--run-dir", str(run_dir),
           "--set", "train.progress='none'", *(a for s in sets for a in ("--set", s))]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.redis
def test_a_resumed_run_takes_the_password_from_the_environment(locked_redis, tiny_data, tmp_path):
    """Run 1 has the password in its URLs; its run directory and checkpoints do not. Run 2
    resumes from the saved config.toml: without the password it stops with one line naming
    Redis; with ``REDIS_PASSWORD`` it connects (spill tier and live pushes) and finishes."""
    from recsys.redisio.live import head_key

    where = f"{locked_redis.host}:{locked_redis.port}/0"
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    first = _train(run_dir, JOB, env, f"data.train.paths=['{tiny_data / 'train'}']",
                   f"data.eval.paths=['{tiny_data / 'eval'}']", "train.max_steps=6", "schema.tables.c1.capacity=150",
                   f"store.spill.url='redis://:{PASSWORD}@{where}'", f"publish.redis='redis://:{PASSWORD}@{where}'",
                   "publish.namespace='secrets'", "publish.every_s=0.05")
    assert first.returncode == 0, first.stderr[-2000:]
    saved = (run_dir / "config.toml").read_text()
    assert f'[store.spill]\nurl = "redis://{where}"' in saved and f'redis = "redis://{where}"' in saved
    assert (run_dir / "checkpoints" / "step-00000006" / "meta.json").is_file()
    assert _files_holding(run_dir, PASSWORD) == [] and PASSWORD not in first.stdout + first.stderr
    client = _client(locked_redis)
    assert any(client.scan_iter(match="*:spill:c1:*"))  # c1 rows past 150 went to Redis

    more = ("train.max_steps=12",)
    refused = _train(run_dir, run_dir / "config.toml", env, *more)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert f"redis://{where}" in refused.stderr and PASSWORD not in refused.stderr + refused.stdout

    resumed = _train(run_dir, run_dir / "config.toml", {**env, PASSWORD_ENV: PASSWORD}, *more)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((run_dir / "result.json").read_text())["step"] == 12
    heads = {k.decode(): json.loads(v)["step"] for k, v in client.hgetall(head_key("secrets")).items()}
    assert heads and max(heads.values()) == 12, heads  # the live pushes of the resumed run reached Redis
    assert _files_holding(run_dir, PASSWORD) == [] and PASSWORD not in resumed.stdout + resumed.stderr
    client.close()


@pytest.mark.redis
def test_export_and_serve_take_the_password_from_a_file_or_the_environment(locked_redis, tiny_run, tmp_path,
                                                                           monkeypatch):
    from embedding_server import export as publish
    from embedding_server.app import create_app
    from embedding_server.settings import ServeSettings

    url = f"redis://{locked_redis.host}:{locked_redis.port}/0"  # no password in it
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    assert publish.export(tiny_run, url, publish.ExportSettings(version="env"), progress=False)["rows"] > 1000
    monkeypatch.delenv(PASSWORD_ENV)
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    settings = ServeSettings(redis=url, redis_password_file=str(tmp_path / "pw"))
    assert PASSWORD not in json.dumps(settings.to_env())
    with LiveServer(create_app(settings)) as live:  # plain redis://: rows come through the RESP pool
        r = httpx.post(live.url + "/v1/lookup", json={"feature": "c1", "ids": [1, 2]}, timeout=30)
        assert r.status_code == 200 and r.json()["version"] == "env", r.text
    with LiveServer(create_app(ServeSettings(redis=url))) as live:  # no password anywhere: 503, not a crash
        r = httpx.post(live.url + "/v1/lookup", json={"feature": "c1", "ids": [1]}, timeout=30)
        assert r.status_code == 503 and "redis://" in r.text


# ------------------------------------------------------------------ ambiguous URLs: a password with '/', '?', '#'

SLASHED = "/Zx9Secret"  # a password that starts with '/': unencoded, the parser sees no password at all
AMBIGUOUS = [  # (url, what redact shows): the '@' that ends the password comes after '/', '?' or '#'
    (f"redis://:{SLASHED}@10.1.2.3:6379/0", "redis://***@10.1.2.3:6379/0"),
    ("redis://default:2024#Zx9Secret@h:6379", "redis://***@h:6379"),  # redis-py: host 'default', port 2024
    ("redis://default:2024?Zx9Secret@h:6379", "redis://***@h:6379"),
    ("rediss://alice:Zx9/Secret@[::1]:6380/0?ssl_cert_reqs=none", "rediss://***@[::1]:6380/0?ssl_cert_reqs=none"),
    ("unix://:Zx9/Secret@/run/redis.sock?db=1", "unix://***@/run/redis.sock?db=1"),
    ("redis://:a@Zx9/Secret@h/0?password=Zx9Secret", "redis://***@h/0?password=***"),
    ("redis://h/0?password=Zx9@Secret", "redis://***"),  # the '@' may be inside a query value: all masked
]


@pytest.mark.parametrize("url, shown", AMBIGUOUS)
def test_an_ambiguous_url_is_masked_whole_and_refused_naming_the_fix(url, shown):
    secret = ("Zx9", "Secret", "2024")
    assert redact(url) == shown and not any(s in redact(url) for s in secret)
    assert redact_text(f"Redis at {url} failed") == f"Redis at {shown} failed"
    assert has_password(url)
    with pytest.raises(ValueError):
        strip_password(url)  # nothing of it may be saved
    with pytest.raises(ValueError, match="store.spill.url: ambiguous Redis URL") as err:
        check_url(url, "store.spill.url")
    message = str(err.value)
    assert not any(s in message for s in secret) and "\n" not in message
    assert "percent-encode the password (/ %2F" in message and "store.spill.password_file" in message
    assert "$REDIS_PASSWORD" in message


@pytest.mark.parametrize("url", ["redis://:pw@cache/0#frag", "redis://:my pw@cache:6379/0", "redis://:p'w@cache/0",
                                 'redis://:p"w@cache/0'])
def test_a_url_messages_could_not_quote_whole_is_refused(url):
    with pytest.raises(ValueError, match="publish.redis: Redis URL .* holds .*publish.redis_password_file") as err:
        check_url(url, "publish.redis")
    assert "pw" not in str(err.value).replace("publish.redis_password_file", "")


def test_the_percent_encoded_forms_are_accepted_and_saved_without_the_password():
    url = "redis://:%2FZx9%3FSe%23c%40ret@10.1.2.3:6379/0"
    check_url(url, "store.spill.url")
    assert parse_url(url)["password"] == "/Zx9?Se#c@ret" and parse_url(url)["host"] == "10.1.2.3"
    assert strip_password(url) == "redis://10.1.2.3:6379/0" and redact(url) == "redis://:***@10.1.2.3:6379/0"
    at_in_password = "redis://u:Zx9@Secret@h:6379/0"  # '@' before the host part ends: every parser agrees
    check_url(at_in_password, "store.spill.url")
    assert parse_url(at_in_password)["password"] == "Zx9@Secret"
    assert redact(at_in_password) == "redis://u:***@h:6379/0" and strip_password(at_in_password) == "redis://u@h:6379/0"


def test_text_that_is_not_a_redis_url_shows_nothing_before_an_at():
    """A URL typed without its scheme, or with another one: the message names the scheme error only."""
    for typed in ("default:Zx9Secret@cache:6379", "http://:Zx9Secret@cache:6379/0"):
        with pytest.raises(ValueError, match="expected a Redis URL") as err:
            check_url(typed, "--redis")
        assert "Zx9Secret" not in str(err.value) and "***@cache:6379" in str(err.value)
    assert "Zx9Secret" not in redact_text("--storage postgresql://bob:Zx9Secret@db/tune failed")
    assert redact_text("see file:///tmp/x?a=b") == "see file:///tmp/x?a=b"  # no '@': untouched


def test_a_saved_job_never_holds_an_ambiguous_url(tmp_path):
    """``dumps`` does not check URLs (a job built in code may skip ``check_url``): it saves what redact shows."""
    from recsys.config import dumps

    text = dumps({"store": {"spill": {"url": f"redis://:{SLASHED}@10.1.2.3:6379/0"}}})
    assert "Zx9" not in text and 'url = "redis://***@10.1.2.3:6379/0"' in text


@pytest.mark.redis
def test_recsys_train_refuses_an_ambiguous_url_and_saves_the_encoded_one_without_its_password(tiny_data, tmp_path):
    """``recsys train`` with the password ``/Zx9Secret`` unencoded: one line naming the fix,
    exit 2, no file holding it. Percent-encoded, as the line says: the run connects to a
    redis-server with that password and its config.toml keeps the URL without it."""
    server = start_redis(tmp_path / "redis", "--requirepass", SLASHED)
    try:
        where = f"{server.host}:{server.port}/0"
        env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
        data = (f"data.train.paths=['{tiny_data / 'train'}']", f"data.eval.paths=['{tiny_data / 'eval'}']",
                "train.max_steps=4", "schema.tables.c1.capacity=150")
        refused = _train(tmp_path / "refused", JOB, env, *data, f"store.spill.url='redis://:{SLASHED}@{where}'")
        assert refused.returncode == 2, refused.stderr[-2000:]
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "ambiguous Redis URL" in lines[0] and "%2F" in lines[0], refused.stderr[-2000:]
        assert "Zx9" not in refused.stderr + refused.stdout
        assert not (tmp_path / "refused").exists() or _files_holding(tmp_path / "refused", "Zx9") == []

        run_dir = tmp_path / "run"
        done = _train(run_dir, JOB, env, *data, f"store.spill.url='redis://:%2FZx9Secret@{where}'",
                      f"publish.redis='redis://:%2FZx9Secret@{where}'", "publish.namespace='slashed'")
        assert done.returncode == 0, done.stderr[-2000:]
        saved = (run_dir / "config.toml").read_text()
        assert f'[store.spill]\nurl = "redis://{where}"' in saved and f'redis = "redis://{where}"' in saved
        assert _files_holding(run_dir, "Zx9") == [] and "Zx9" not in done.stdout + done.stderr
        import redis

        client = redis.Redis(host=server.host, port=server.port, password=SLASHED)
        assert any(client.scan_iter(match="*:spill:c1:*")) and client.exists("slashed:live:head")
        client.close()
    finally:
        server.stop()
