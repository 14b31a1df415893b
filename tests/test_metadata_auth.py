"""Credentials for the metadata stores, without servers: the URL forms, ``metadata_auth``'s checks
and their wording, redaction, and the http metadata server's token check (in process).

The same against real etcd, redis and http servers over TLS is ``test_metadata_auth_e2e``.
"""

from __future__ import annotations

import logging
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from harness import servers
from mooncake_vllm.core.settings import ConfigError
from mooncake_vllm.metadata import (
    MemoryStore,
    MetadataAuth,
    MetadataTarget,
    StoreUnavailable,
    check_auth,
    open_store,
    parse_metadata_server,
    redact_url,
)
from mooncake_vllm.p2p.config import load_settings
from mooncake_vllm.transfer.http_store import main as metadata_server_main
from mooncake_vllm.transfer.store_bridge import (
    KeyScope,
    MetadataBridge,
    MetadataUnavailable,
    metadata_app,
)

SECRET = "hunter2-not-for-logs"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "password"
    path.write_text(SECRET + "\n")  # as `echo secret > file` writes it
    return str(path)


@pytest.mark.parametrize(
    ("server", "backend", "target"),
    [
        ("etcds://h:2379", None, MetadataTarget("etcd", ("h:2379",), tls=True)),
        ("etcds://h1:2379,h2:2379", "etcd", MetadataTarget("etcd", ("h1:2379", "h2:2379"), True)),
        ("etcd://h:2379", None, MetadataTarget("etcd", ("h:2379",), tls=False)),
        ("rediss://h:6380", None, MetadataTarget("redis", ("rediss://h:6380",), tls=True)),
        ("rediss://h:6380/2", "redis", MetadataTarget("redis", ("rediss://h:6380/2",), True)),
        ("redis://:pw@h:6379", None, MetadataTarget("redis", ("redis://:pw@h:6379",))),
        (
            "https://h:8080/metadata",
            None,
            MetadataTarget("http", ("https://h:8080/metadata",), True),
        ),
        ("h:6379", "redis", MetadataTarget("redis", ("redis://h:6379",))),
    ],
)
def test_tls_is_chosen_by_the_scheme(server, backend, target):
    assert parse_metadata_server(server, backend) == target


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://app:{SECRET}@h:6379/0", "redis://***@h:6379/0"),
        (f"rediss://:{SECRET}@h:6380", "rediss://***@h:6380"),
        ("redis://app@h:6379", "redis://***@h:6379"),
        (f"http://h:8080/metadata?token={SECRET}&x=1", "http://h:8080/metadata?token=***&x=1"),
        (f"redis://h:6379?password={SECRET}", "redis://h:6379?password=***"),
        (f"app:{SECRET}@h:6379", "***@h:6379"),  # the bare form, read with metadata_backend
        ("etcd://h:2379", "etcd://h:2379"),
        ("h:2379", "h:2379"),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_describe_and_parse_errors_never_show_a_password():
    target = parse_metadata_server(f"rediss://app:{SECRET}@h:6380")
    assert target.describe() == "redis rediss://***@h:6380"
    assert MetadataTarget("etcd", ("h:1", "h:2"), tls=True).describe() == "etcd h:1,h:2 (TLS)"
    for server, backend, expected in [
        (f"redis://app:{SECRET}@", None, "is not 'host:port'"),
        (f"etcd://root:{SECRET}@h:2379", None, "credentials do not go in an etcd URL"),
        (f"redis://:{SECRET}@h:6379", "etcd", "contradicts"),
        (f"ftp://u:{SECRET}@h:1", None, "accepted forms"),
    ]:
        with pytest.raises(ValueError, match=expected) as exc:
            parse_metadata_server(server, backend)
        assert SECRET not in str(exc.value)
        assert "***@" in str(exc.value)


def test_secrets_are_read_from_the_file_or_variable_when_used(secret_file, monkeypatch):
    auth = MetadataAuth(user="root", password_file=secret_file)
    assert auth.password() == SECRET  # the file's line break is not part of it
    with open(secret_file, "w") as f:
        f.write("rotated")
    assert auth.password() == "rotated"  # no restart needed
    monkeypatch.setenv("MY_TOKEN", SECRET)
    assert MetadataAuth(token_env="MY_TOKEN").token() == SECRET
    assert MetadataAuth().password() is None
    assert SECRET not in repr(MetadataAuth(token_env="MY_TOKEN"))


@pytest.mark.parametrize(
    ("fields", "loc", "expected"),
    [
        ({"password_file": "/nonexistent/pw"}, "password_file", "cannot be read (No such file"),
        ({"token_env": "MOONCAKE_TEST_UNSET"}, "token_env", "environment variable is not set"),
        ({"ca_file": "/nonexistent/ca.pem"}, "ca_file", "cannot be read"),
        ({"password_file": "EMPTY"}, "password_file", "the file is empty"),
        ({"password_file": "PW", "password_env": "PW_ENV"}, None, "password_file or password_env"),
        ({"token_file": "PW", "token_env": "PW_ENV"}, None, "token_file or token_env, not both"),
        ({"user": "root"}, None, "user='root' has no password; set password_file or"),
        ({"key_file": "PW"}, None, "key_file without cert_file"),
        ({"ca_file": "PW"}, None, "ca_file='PW' is not a PEM CA certificate"),
        ({"cert_file": "PW"}, None, "cert_file='PW' does not load with its private key in the"),
        ({"password": SECRET}, "password", "Extra inputs are not permitted"),
    ],
)
def test_metadata_auth_errors_name_the_key_and_the_fix(
    fields, loc, expected, secret_file, tmp_path, monkeypatch
):
    monkeypatch.delenv("MOONCAKE_TEST_UNSET", raising=False)
    monkeypatch.setenv("PW_ENV", SECRET)
    (tmp_path / "empty").write_text("\n")
    files = {"PW": secret_file, "EMPTY": str(tmp_path / "empty")}
    fields = {k: files.get(v, v) for k, v in fields.items()}
    with pytest.raises(ValidationError) as exc:
        MetadataAuth(**fields)
    (error,) = exc.value.errors()
    assert error["loc"] == ((loc,) if loc else ())
    assert expected.replace("'PW'", repr(secret_file)) in error["msg"]
    assert SECRET not in error["msg"]


def test_the_connector_config_reports_metadata_auth_problems_by_key():
    with pytest.raises(ConfigError) as exc:
        load_settings(
            {"metadata_server": "etcds://h:2379", "metadata_auth": {"password_file": "/no/pw"}},
            env={},
        )
    assert "metadata_auth.password_file='/no/pw': cannot be read" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        load_settings({"metadata_auth": {"password": SECRET}}, env={})
    assert "unknown key 'metadata_auth.password'" in str(exc.value)
    assert SECRET not in str(exc.value)


@pytest.mark.parametrize(
    ("server", "fields", "expected"),
    [
        ("etcd://h:1", {"ca_file": "CA"}, "plain etcd:// connection; use 'etcds://...'"),
        ("redis://h:1", {"cert_file": "CERT", "key_file": "KEY"}, "use 'rediss://...'"),
        ("http://h:1/metadata", {"ca_file": "CA"}, "use 'https://...'"),
        ("etcds://h:1", {"token_file": "PW"}, "token_file/token_env are for the http"),
        ("redis://h:1", {"token_file": "PW"}, "takes metadata_auth.user and password_file"),
        ("etcd://h:1", {"password_file": "PW"}, "set metadata_auth.user (e.g. 'root')"),
        ("redis://:x@h:1", {"password_file": "PW"}, "drop them from the URL"),
        ("http://h:1/metadata", {"user": "u", "password_file": "PW"}, "takes a bearer token"),
        ("P2PHANDSHAKE", {"token_file": "PW"}, "metadata_server is P2PHANDSHAKE"),
    ],
)
def test_credentials_must_fit_the_store(server, fields, expected, secret_file, tmp_path):
    from harness.tls import make_pki

    pki = make_pki(tmp_path / "pki")
    files = {"PW": secret_file, "CA": str(pki.ca_cert), "CERT": str(pki.client_cert)}
    files["KEY"] = str(pki.client_key)
    auth = MetadataAuth(**{k: files.get(v, v) for k, v in fields.items()})
    target = parse_metadata_server(server)
    with pytest.raises(ValueError, match=re.escape(expected)):
        check_auth(target, auth)
    if target.kind != "p2p":
        with pytest.raises(ValueError, match="metadata_auth"):
            open_store(target, auth)
        with pytest.raises(MetadataUnavailable, match="cannot be used"):
            MetadataBridge(target, auth=auth, scope=KeyScope(frozenset()))  # before any process


@pytest.mark.parametrize(
    ("server", "fields"),
    [
        ("etcds://h:1", {"user": "root", "password_file": "PW", "ca_file": "CA"}),
        ("etcd://h:1", {"user": "root", "password_file": "PW"}),
        ("rediss://h:1", {"password_file": "PW", "ca_file": "CA", "cert_file": "CERT"}),
        ("redis://h:1", {"user": "app", "password_file": "PW"}),
        ("https://h:1/metadata", {"token_file": "PW", "ca_file": "CA"}),
        ("http://h:1/metadata", {"token_file": "PW"}),
        ("etcds://h:1", {}),  # the system's CAs
    ],
)
def test_credentials_that_fit(server, fields, secret_file, tmp_path):
    from harness.tls import make_pki

    pki = make_pki(tmp_path / "pki")
    files = {
        "PW": secret_file,
        "CA": str(pki.ca_cert),
        "CERT": str(pki.client_cert),
    }
    fields = {k: files.get(v, v) for k, v in fields.items()}
    if "cert_file" in fields:
        fields["key_file"] = str(pki.client_key)
    check_auth(parse_metadata_server(server), MetadataAuth(**fields))


async def test_a_password_in_the_url_works_is_warned_about_and_never_shown(caplog):
    port = servers.free_port()  # nothing listens: the error must not show the password either
    target = parse_metadata_server(f"redis://app:{SECRET}@127.0.0.1:{port}")
    with caplog.at_level(logging.WARNING, logger="mooncake_vllm.metadata.factory"):
        store = open_store(target)
    try:
        assert "carries credentials in its URL" in caplog.text
        assert f"redis://***@127.0.0.1:{port}" in caplog.text
        with pytest.raises(StoreUnavailable) as exc:
            await store.ping()
        assert f"redis://***@127.0.0.1:{port}" in str(exc.value)
    finally:
        await store.close()
    assert SECRET not in caplog.text
    assert SECRET not in str(exc.value)


async def test_our_http_server_wants_the_token_on_every_route_but_health():
    app = metadata_app(MemoryStore(), token=SECRET)
    async with TestClient(TestServer(app)) as client:
        good = {"Authorization": f"Bearer {SECRET}"}
        requests = [
            ("PUT", {"key": "k"}),
            ("GET", {"key": "k"}),
            ("GET", {"prefix": "k"}),  # listing
            ("DELETE", {"key": "k"}),
        ]
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET}):
            for method, params in requests:
                resp = await client.request(method, "/metadata", params=params, headers=headers)
                assert resp.status == 401, (method, params, headers)
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
                assert SECRET not in await resp.text()
        assert (await client.get("/health")).status == 200
        statuses = []
        for method, params in requests:
            resp = await client.request(method, "/metadata", params=params, headers=good, data=b"v")
            statuses.append(resp.status)
        assert statuses == [200, 200, 200, 200]


def test_the_server_cli_takes_the_token_from_a_file_or_variable_only(capsys, monkeypatch):
    monkeypatch.delenv("MOONCAKE_TEST_UNSET", raising=False)
    for argv, expected in [
        (["--token-env", "MOONCAKE_TEST_UNSET"], "--token-env='MOONCAKE_TEST_UNSET': the envir"),
        (["--token-file", "/nonexistent"], "--token-file='/nonexistent': cannot be read"),
        (["--token-file", "f", "--token-env", "E"], "set --token-file or --token-env, not both"),
    ]:
        with pytest.raises(SystemExit):
            metadata_server_main(argv)
        assert expected in capsys.readouterr().err


async def test_the_http_store_says_which_key_to_set(secret_file):
    async with TestServer(metadata_app(MemoryStore(), token="the-right-token")) as server:
        url = f"http://{server.host}:{server.port}/metadata"
        for auth, expected in [
            (MetadataAuth(), "wants a bearer token; set metadata_auth.token_file or token_env"),
            (MetadataAuth(token_file=secret_file), "refused the bearer token"),
        ]:
            store = open_store(parse_metadata_server(url), auth)
            try:
                with pytest.raises(StoreUnavailable, match=expected) as exc:
                    await store.put("k", b"v")
                assert SECRET not in str(exc.value)
            finally:
                await store.close()
