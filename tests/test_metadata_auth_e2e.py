"""The metadata stores with credentials, against real servers on loopback (no vLLM):

- etcd over TLS (a throwaway CA, client certificates required) with authentication on: a root
  user and a user allowed only keys it does not need, tokens that expire after 2 s idle;
- redis over TLS only, with ``requirepass`` and an ACL user, client certificates required;
- our http metadata server with a bearer token.

Each works with the right credentials (put/get/list/delete, keys with a TTL, the bridge the
workers use) and fails with wrong or missing ones, the error naming what to set and never a
secret.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import redis

from harness import servers
from harness.tls import make_pki
from mooncake_vllm.metadata import (
    MetadataAuth,
    StoreAuthError,
    StoreUnavailable,
    open_store,
    parse_metadata_server,
)
from mooncake_vllm.transfer.store_bridge import KeyScope, MetadataBridge, MetadataUnavailable

pytestmark = pytest.mark.servers

# Fresh for each run, so a leak in a message or a log cannot match an older run's value.
ROOT_PASSWORD = secrets.token_urlsafe(12)
LIMITED_PASSWORD = secrets.token_urlsafe(12)
REDIS_PASSWORD = secrets.token_urlsafe(12)
APP_PASSWORD = secrets.token_urlsafe(12)
HTTP_TOKEN = secrets.token_urlsafe(16)
ALL_SECRETS = (ROOT_PASSWORD, LIMITED_PASSWORD, REDIS_PASSWORD, APP_PASSWORD, HTTP_TOKEN)
ETCD_TOKEN_TTL_S = 2


def _assert_no_secret(text: str) -> None:
    for secret in ALL_SECRETS:
        assert secret not in text


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The throwaway CA, an unrelated one, and one file per secret."""
    root = tmp_path_factory.mktemp("metadata-auth")
    paths = {"pki": make_pki(root / "pki"), "other_pki": make_pki(root / "other-pki")}
    for name, secret in [
        ("root_password", ROOT_PASSWORD),
        ("limited_password", LIMITED_PASSWORD),
        ("redis_password", REDIS_PASSWORD),
        ("app_password", APP_PASSWORD),
        ("http_token", HTTP_TOKEN),
        ("wrong", "not-the-secret"),
    ]:
        path = root / name
        path.write_text(secret + "\n")
        path.chmod(0o600)
        paths[name] = str(path)
    return paths


def _tls(pki, **fields) -> MetadataAuth:
    """``fields`` + the CA and client certificate of ``pki``."""
    return MetadataAuth(
        ca_file=str(pki.ca_cert),
        cert_file=str(pki.client_cert),
        key_file=str(pki.client_key),
        **fields,
    )


# ---- etcd ---------------------------------------------------------------------------------------


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _enable_etcd_auth(url: str, auth: MetadataAuth) -> None:
    """What an operator does with etcdctl, through the JSON gateway: a root user, a user whose
    role may only read 'other/', then ``auth enable``."""
    calls = [
        ("role/add", {"name": "root"}),
        ("user/add", {"name": "root", "password": ROOT_PASSWORD}),
        ("user/grant", {"user": "root", "role": "root"}),
        ("role/add", {"name": "other-reader"}),
        (
            "role/grant",
            {
                "name": "other-reader",
                "perm": {"permType": "READ", "key": _b64("other/"), "range_end": _b64("other0")},
            },
        ),
        ("user/add", {"name": "limited", "password": LIMITED_PASSWORD}),
        ("user/grant", {"user": "limited", "role": "other-reader"}),
        ("enable", {}),
    ]
    for path, body in calls:
        request = urllib.request.Request(f"{url}/v3/auth/{path}", data=json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=10, context=auth.ssl_context()) as resp:
            assert resp.status == 200, (path, resp.status)


@pytest.fixture(scope="module")
def etcd(module_servers, files):
    srv = module_servers(
        servers.start_etcd,
        tls=files["pki"],
        extra_args=["--auth-token", "simple", "--auth-token-ttl", str(ETCD_TOKEN_TTL_S)],
    )
    _enable_etcd_auth(f"https://{srv.host}:{srv.port}", _tls(files["pki"]))
    return parse_metadata_server(f"etcds://{srv.host}:{srv.port}")


async def _round_trip(target, auth: MetadataAuth) -> None:
    """What the bridge and the proxy's discovery do with a store."""
    store = open_store(target, auth)
    try:
        await store.ping()
        prefix = f"mooncake-vllm/engines/auth-{secrets.token_hex(4)}/"
        await store.put(prefix + "0", b'{"rank": 0}')
        await store.put(prefix + "1", b'{"rank": 1}', ttl_s=30)
        assert await store.get(prefix + "0") == b'{"rank": 0}'
        assert await store.list(prefix) == {
            prefix + "0": b'{"rank": 0}',
            prefix + "1": b'{"rank": 1}',
        }
        await store.delete(prefix + "0")
        assert await store.get(prefix + "0") is None
        assert list(await store.list(prefix)) == [prefix + "1"]
    finally:
        await store.close()


async def _refusal(target, auth: MetadataAuth) -> str:
    """The message of the error the store's first use raises (a StoreAuthError)."""
    store = open_store(target, auth)
    try:
        with pytest.raises(StoreAuthError) as exc:
            await store.ping()
    finally:
        await store.close()
    message = str(exc.value)
    _assert_no_secret(message)
    return message


async def test_etcd_over_tls_with_a_user(etcd, files):
    await _round_trip(etcd, _tls(files["pki"], user="root", password_file=files["root_password"]))


async def test_etcd_logs_in_again_when_its_token_expired(etcd, files, monkeypatch):
    monkeypatch.setenv("ETCD_ROOT_PASSWORD", ROOT_PASSWORD)
    store = open_store(etcd, _tls(files["pki"], user="root", password_env="ETCD_ROOT_PASSWORD"))
    try:
        await store.put("mooncake/auth-test", b"1")
        time.sleep(ETCD_TOKEN_TTL_S + 1.5)  # etcd drops a simple token idle this long
        await store.put("mooncake/auth-test", b"2")  # refused once (401), then logged in again
        assert await store.get("mooncake/auth-test") == b"2"
        await store.delete("mooncake/auth-test")
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no user", "etcd has authentication on and no user was given; set metadata_auth.user"),
        ("wrong password", "logging in as user 'root' failed"),
        ("password of another user", "logging in as user 'root' failed"),
        ("user without permission", "user 'limited' is not permitted"),
        ("another CA", "did not verify: set metadata_auth.ca_file"),
        (
            "no client certificate",
            "wants a client certificate signed by its CA: set metadata_auth.cert_file",
        ),
    ],
)
async def test_etcd_refuses_wrong_or_missing_credentials(etcd, files, case, expected):
    pki = files["pki"]
    auth = {
        "no user": _tls(pki),
        "wrong password": _tls(pki, user="root", password_file=files["wrong"]),
        "password of another user": _tls(pki, user="root", password_file=files["limited_password"]),
        "user without permission": _tls(
            pki, user="limited", password_file=files["limited_password"]
        ),
        "another CA": _tls(files["other_pki"], user="root", password_file=files["root_password"]),
        "no client certificate": MetadataAuth(
            ca_file=str(pki.ca_cert), user="root", password_file=files["root_password"]
        ),
    }[case]
    assert expected in await _refusal(etcd, auth)


async def test_a_user_for_an_etcd_without_authentication_is_an_error(module_servers, files):
    """Credentials the store ignores would make the operator believe the keys are protected."""
    srv = module_servers(servers.start_etcd)
    target = parse_metadata_server(srv.url)
    auth = MetadataAuth(user="root", password_file=files["root_password"])
    assert "etcd has authentication off; enable it" in await _refusal(target, auth)


async def test_plain_etcd_against_its_tls_port_fails(etcd, files):
    plain = parse_metadata_server(f"etcd://{etcd.endpoints[0]}")
    store = open_store(plain, MetadataAuth(user="root", password_file=files["root_password"]))
    try:
        with pytest.raises(StoreUnavailable) as exc:
            await store.ping()
    finally:
        await store.close()
    assert "if the server speaks TLS on this port, use 'etcds://'" in str(exc.value)
    _assert_no_secret(str(exc.value))


# ---- redis --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_tls(module_servers, files):
    pki = files["pki"]
    srv = module_servers(servers.start_redis, tls=pki, extra_args=["--requirepass", REDIS_PASSWORD])
    admin = redis.Redis(
        host=srv.host, port=srv.port, password=REDIS_PASSWORD, ssl=True,
        ssl_ca_certs=str(pki.ca_cert), ssl_certfile=str(pki.client_cert),
        ssl_keyfile=str(pki.client_key),
    )  # fmt: skip
    admin.acl_setuser("app", enabled=True, passwords=[f"+{APP_PASSWORD}"], keys=["mooncake*"],
                      commands=["+@all"])  # fmt: skip
    admin.acl_setuser("limited", enabled=True, passwords=[f"+{LIMITED_PASSWORD}"],
                      keys=["other*"], commands=["+@all"])  # fmt: skip
    admin.close()
    return srv


async def test_redis_over_tls_with_a_password_or_an_acl_user(redis_tls, files, monkeypatch):
    target = parse_metadata_server(f"rediss://{redis_tls.host}:{redis_tls.port}")
    await _round_trip(target, _tls(files["pki"], password_file=files["redis_password"]))
    monkeypatch.setenv("REDIS_APP_PASSWORD", APP_PASSWORD)
    await _round_trip(target, _tls(files["pki"], user="app", password_env="REDIS_APP_PASSWORD"))


async def test_redis_password_in_the_url_still_works(redis_tls, files):
    target = parse_metadata_server(f"rediss://:{REDIS_PASSWORD}@{redis_tls.host}:{redis_tls.port}")
    _assert_no_secret(target.describe())
    await _round_trip(target, _tls(files["pki"]))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no password", "wants a password and none is configured; set metadata_auth.password_"),
        ("wrong password", "refused our user or password (invalid username-password pair"),
        ("user without permission", "the ACL user may not do this"),
        ("another CA", "did not verify: set metadata_auth.ca_file"),
        (
            "no client certificate",
            # The alert, or (TLS 1.3, a busy host) the hang-up after the handshake.
            "a client certificate signed by its CA, set metadata_auth.cert_file|"
            "wants a client certificate signed by its CA: set metadata_auth.cert_file",
        ),
    ],
)
async def test_redis_refuses_wrong_or_missing_credentials(redis_tls, files, case, expected):
    pki = files["pki"]
    target = parse_metadata_server(f"rediss://{redis_tls.host}:{redis_tls.port}")
    auth = {
        "no password": _tls(pki),
        "wrong password": _tls(pki, password_file=files["wrong"]),
        "user without permission": _tls(
            pki, user="limited", password_file=files["limited_password"]
        ),
        "another CA": _tls(files["other_pki"], password_file=files["redis_password"]),
        "no client certificate": MetadataAuth(
            ca_file=str(pki.ca_cert), password_file=files["redis_password"]
        ),
    }[case]
    if case == "user without permission":  # PING needs no key: the first put is refused
        store = open_store(target, auth)
        try:
            with pytest.raises(StoreAuthError) as exc:
                await store.put("mooncake/x", b"1")
        finally:
            await store.close()
        message = str(exc.value)
        _assert_no_secret(message)
    else:
        message = await _refusal(target, auth)
    assert any(e in message for e in expected.split("|")), message


# ---- http ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http_with_token(module_servers, files):
    srv = module_servers(
        servers.start_http_metadata, extra_args=["--token-file", files["http_token"]]
    )
    return parse_metadata_server(srv.url)


async def test_http_metadata_server_with_a_token(http_with_token, files, monkeypatch):
    await _round_trip(http_with_token, MetadataAuth(token_file=files["http_token"]))
    monkeypatch.setenv("HTTP_METADATA_TOKEN", HTTP_TOKEN)
    await _round_trip(http_with_token, MetadataAuth(token_env="HTTP_METADATA_TOKEN"))


async def test_http_metadata_server_refuses_every_request_without_its_token(http_with_token, files):
    url = http_with_token.endpoints[0]
    async with aiohttp.ClientSession() as session:
        for method, params in [
            ("GET", {"key": "k"}),
            ("GET", {"prefix": "mooncake"}),
            ("PUT", {"key": "k"}),
            ("DELETE", {"key": "k"}),
        ]:
            async with session.request(method, url, params=params, data=b"v") as resp:
                assert resp.status == 401, (method, params)
        async with session.get(url.replace("/metadata", "/health")) as resp:
            assert resp.status == 200
    assert "wants a bearer token" in await _refusal(http_with_token, MetadataAuth())
    wrong = MetadataAuth(token_file=files["wrong"])
    assert "refused the bearer token" in await _refusal(http_with_token, wrong)


# ---- the bridge (what each vLLM worker runs) ----------------------------------------------------


def _bridge_round_trip(target, auth: MetadataAuth) -> None:
    key = f"mooncake/ram/auth-bridge-{secrets.token_hex(4)}"
    bridge = MetadataBridge(target, ttl_s=5, auth=auth, scope=KeyScope(frozenset({key})))
    try:
        # The store's URL and credentials are not on the bridge's command line.
        cmdline = Path(f"/proc/{bridge._proc.pid}/cmdline").read_bytes().decode()
        assert "mooncake_vllm.transfer.store_bridge" in cmdline
        for endpoint in target.endpoints:
            assert endpoint not in cmdline
        _assert_no_secret(cmdline)
        bridge.publish(key, b"segment")
        assert bridge.lookup(key) == b"segment"
        assert bridge.lookup(key + "-absent") is None
    finally:
        bridge.close()


@pytest.mark.parametrize("kind", ["etcds", "rediss", "http"])
def test_the_bridge_works_over_each_store_with_credentials(
    kind, etcd, redis_tls, http_with_token, files, monkeypatch
):
    monkeypatch.setenv("MOONCAKE_TEST_SECRET", {"etcds": ROOT_PASSWORD, "rediss": REDIS_PASSWORD,
                                                "http": HTTP_TOKEN}[kind])  # fmt: skip
    if kind == "etcds":
        target, auth = etcd, _tls(files["pki"], user="root", password_env="MOONCAKE_TEST_SECRET")
    elif kind == "rediss":
        target = parse_metadata_server(f"rediss://{redis_tls.host}:{redis_tls.port}")
        auth = _tls(files["pki"], password_env="MOONCAKE_TEST_SECRET")
    else:
        target, auth = http_with_token, MetadataAuth(token_env="MOONCAKE_TEST_SECRET")
    _bridge_round_trip(target, auth)


def test_the_bridge_with_a_password_in_the_redis_url(redis_tls, files):
    target = parse_metadata_server(f"rediss://:{REDIS_PASSWORD}@{redis_tls.host}:{redis_tls.port}")
    _bridge_round_trip(target, _tls(files["pki"]))


@pytest.mark.parametrize("kind", ["etcds", "rediss", "http"])
def test_a_bridge_with_wrong_credentials_stops_the_worker_at_startup(
    kind, etcd, redis_tls, http_with_token, files
):
    pki = files["pki"]
    if kind == "etcds":
        target, auth = etcd, _tls(pki, user="root", password_file=files["wrong"])
        expected = "logging in as user 'root' failed"
    elif kind == "rediss":
        target = parse_metadata_server(f"rediss://{redis_tls.host}:{redis_tls.port}")
        auth, expected = _tls(pki, password_file=files["wrong"]), "refused our user or password"
    else:
        target = http_with_token
        auth, expected = MetadataAuth(token_file=files["wrong"]), "refused the bearer token"
    with pytest.raises(MetadataUnavailable) as exc:
        MetadataBridge(target, auth=auth, scope=KeyScope(frozenset()))
    message = str(exc.value)
    assert f"metadata_server ({target.describe()}) cannot be used" in message
    assert expected in message
    assert "metadata_auth" in message
    _assert_no_secret(message)
