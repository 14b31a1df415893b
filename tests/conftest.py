"""Shared fixtures: the tiny model and real servers, with their logs printed when a test fails."""

from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import servers
from harness.pd import stop_servers
from harness.tiny_model import build_tiny_model
from mooncake_vllm.core.auth import new_secret


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def _failed(request) -> bool:
    return any(
        getattr(getattr(request.node, f"rep_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(build_tiny_model())


@pytest.fixture
def log_on_failure(request):
    """Register servers whose log tail is printed if the test fails: ``log_on_failure(srv)``."""
    watched: list = []
    yield watched.append
    if _failed(request):
        for srv in watched:
            proc = getattr(srv, "process", srv)
            print(f"\n===== log of {proc.name} ({proc.log_path}) =====\n{proc.log_tail()}")


@pytest.fixture(scope="module")
def module_servers(request):
    """Start servers for a module; stop them all at module end, printing logs if any test failed."""
    started: list = []

    def start(fn, *args, **kwargs):
        srv = fn(*args, **kwargs)
        started.append(srv)
        return srv

    yield start
    stop_servers(started, print_logs=request.session.testsfailed > 0)


@pytest.fixture(autouse=True, scope="session")
def _no_process_left_behind():
    yield
    servers.stop_all()


# ---- the shared disaggregated cluster ---------------------------------------------------------

# vLLM takes minutes to start on 2 cores, so one plain server, one prefill/decode pair and one
# kv_both server serve every test module that needs them; they start together, once.

CLUSTER_MAX_MODEL_LEN = 16_384
PREFILL_BATCHED_TOKENS = 2048
LEASE_TTL_S = 10.0
# The layout module's engines (tests/test_layout_e2e.py), a TP2 one and one with 64-token blocks:
# the shared "both" engine pulls from them.
WIDE_HOST, NARROW_HOST = "127.0.0.9", "127.0.0.10"
LOAD_TIMEOUT_S = 10.0


# ---- servers started ahead, beside tests that leave a core idle ---------------------------------
# A vLLM start keeps a core busy for most of a minute (imports); most tests send a request at a
# time and leave a core idle. So the tests without servers run first, beside the shared cluster's
# start; and a module with servers of its own may define ``prestart(cluster, tmp)`` (``tmp``
# a directory of its own; returning what its module fixture starts, taken with ``prestarted``),
# which the module that runs before it begins in the background if it says its tests may share
# the machine
# (``SHARES_THE_MACHINE = True``: none of its assertions depends on timing). These modules run
# first among those with servers, in this order; the others follow alphabetically.
#
# A background start gets directories, never ``tmp_path_factory``: pytest's factory makes its
# base directory lazily and not thread-safely (``getbasetemp``, pytest 9.2), so a thread calling
# ``mktemp`` while the first unit test asks for ``tmp_path`` could make a second base directory
# and fail with "pd is not a normalized and relative path" (issue 53: 274 errors on a fresh
# machine). Every directory a background job writes to is made on the main thread before the
# job is submitted (``_cluster_start``, ``pytest_runtest_setup``); tests/test_suite_threads.py
# proves it with a slowed factory.
SERVER_MODULES_FIRST = ["test_api_matrix_e2e", "test_layout_e2e"]
_ahead: dict[str, Future] = {}
_session: dict = {}  # the cluster's start, tmp_path_factory and a thread pool, once they exist
_shared: set[str] = set()  # modules whose first test has begun the next module's start


def pytest_collection_modifyitems(session, config, items):
    def key(item) -> tuple[bool, int]:
        name = item.module.__name__
        first = SERVER_MODULES_FIRST.index(name) if name in SERVER_MODULES_FIRST else 99
        return item.get_closest_marker("servers") is not None, first

    items.sort(key=key)


def pytest_runtest_setup(item):
    """At a module's first test, if it shares the machine, the next module's ``prestart``."""
    module = item.module
    if not getattr(module, "SHARES_THE_MACHINE", False) or module.__name__ in _shared:
        return
    _shared.add(module.__name__)
    items = item.session.items
    nxt = next((i.module for i in items[items.index(item) :] if i.module is not module), None)
    if nxt is None or not hasattr(nxt, "prestart") or "pool" not in _session:
        return
    cluster = _session["cluster"]
    tmp = _session["tmp"].mktemp(nxt.__name__)  # on the main thread: see above
    _ahead[nxt.__name__] = _session["pool"].submit(lambda: nxt.prestart(cluster.result(), tmp))


def prestarted(module_name: str, start):
    """The servers ``start()`` returns: begun ahead (see above) or started now."""
    ahead = _ahead.pop(module_name, None)
    return ahead.result() if ahead is not None else start()


@pytest.fixture(autouse=True, scope="session")
def _cluster_start(request, tmp_path_factory):
    """Starts the shared cluster in the background at the session's first test, if a selected
    test needs it: on 2 cores its minute and a half of imports overlaps the single-threaded
    unit tests that run first, instead of following them."""
    if not any("cluster" in item.fixturenames for item in request.session.items):
        yield None
        return
    model = request.getfixturevalue("tiny_model")  # built here: tests may build it too
    # Made here, on the main thread, before the thread starts (see "A background start" above).
    tmp = tmp_path_factory.mktemp("pd")
    with ThreadPoolExecutor(2, thread_name_prefix="servers-ahead") as pool:
        start = pool.submit(_start_cluster, model, tmp)
        _session.update(cluster=start, tmp=tmp_path_factory, pool=pool)
        yield start
        if not all(f.done() for f in (start, *_ahead.values())):
            servers.stop_all()  # the session ended early: its servers stop, so the starts fail
        for ahead in _ahead.values():  # begun for a module that did not take them
            with contextlib.suppress(Exception):
                for srv in ahead.result():
                    srv.stop()
        if start.exception() is None:
            start.result().stop()


@pytest.fixture(scope="session")
def cluster(_cluster_start: Future | None):
    if _cluster_start is None:
        pytest.fail("the shared cluster was not started: no selected test was seen to need it")
    c = _cluster_start.result()
    yield c
    if c.dump_logs:
        for srv in c.servers:
            proc = srv.process
            print(f"\n===== log of {proc.name} ({proc.log_path}) =====\n{proc.log_tail()}")


def _start_cluster(model: str, tmp: Path) -> Cluster:
    from harness.pd import (
        DECODE_HOST,
        PREFILL_HOST,
        ServerSpec,
        kv_args,
        mooncake_json,
        reference_spec,
        start_many,
    )

    # The shared pair runs with a shared secret, as a cluster reachable by others should: every
    # test on it goes through the authenticated side channel (the one-address new-user setup
    # and the other modules' own pairs run without one).
    secret = tmp / "secret"
    secret.write_text(new_secret() + "\n")
    cfg = mooncake_json(tmp / "mooncake.json", auth_secret_file=str(secret))
    env = {"MOONCAKE_CONFIG_PATH": str(cfg)}
    specs = [
        reference_spec("plain"),
        # With layerwise_handoff (off by default): every test on the pair goes through the lease
        # opened in the prefill's last step; those with concurrent dispatch read layer by layer.
        # The other modules' producers run without it.
        ServerSpec(
            "prefill",
            PREFILL_HOST,
            [
                *kv_args(
                    "kv_producer",
                    {
                        "lease_ttl_s": LEASE_TTL_S,
                        "layerwise_handoff": True,
                        # Where Dynamo's prefill worker tells decodes to ask (vLLM's
                        # get_mooncake_bootstrap_addr reads this key; test_upstream_e2e.py).
                        "bootstrap_server_address": f"{PREFILL_HOST}:8998",
                    },
                ),
                # vLLM's CPU default, spelled out: a longer prompt is computed in several
                # steps (tests/test_long_prompts_e2e.py).
                "--max-num-batched-tokens",
                str(PREFILL_BATCHED_TOKENS),
            ],
            env,
        ),
        ServerSpec(
            "decode",
            DECODE_HOST,
            kv_args(
                "kv_consumer",
                {"load_timeout_s": LOAD_TIMEOUT_S},
                kv_load_failure_policy="recompute",
            ),
            env,
        ),
    ]
    # A kv_both instance on its own "host", failing (not recomputing) requests whose load fails.
    # It selects the connector the explicit way, with vLLM's plugins off, so that form is proven.
    both_args = kv_args(
        "kv_both",
        {
            "prefill_url": "127.0.0.4:13020",
            "load_timeout_s": LOAD_TIMEOUT_S,
            # It pulls from the pair's prefill, itself, the MLA module's prefill (whose
            # handoff it must refuse by compat hash) and the layout module's engines only: a
            # handoff naming another producer is refused before any frame
            # (tests/test_hostile_peers_e2e.py).
            "trusted_producers": [PREFILL_HOST, "127.0.0.4", "127.0.0.6", WIDE_HOST, NARROW_HOST],
        },
        kv_load_failure_policy="fail",
        kv_connector_module_path="mooncake_vllm.connector",
    )
    specs.append(ServerSpec("both", "127.0.0.4", both_args, {**env, "VLLM_PLUGINS": ""}))
    # Room for the long prompts of tests/test_long_prompts_e2e.py (the KV cache holds ~130k
    # tokens of the tiny model); the other modules' engines keep start_vllm's 2048.
    specs = [dataclasses.replace(s, max_model_len=CLUSTER_MAX_MODEL_LEN) for s in specs]
    return Cluster(model, *start_many(model, specs), config_path=cfg, secret_path=secret)


class Cluster:
    def __init__(self, model, plain, prefill, decode, both, config_path, secret_path):
        self.model, self.plain, self.prefill, self.decode = model, plain, prefill, decode
        self.both = both
        self.config_path, self.secret_path = config_path, secret_path
        self.lease_ttl_s, self.load_timeout_s = LEASE_TTL_S, LOAD_TIMEOUT_S
        self.dump_logs = False

    @property
    def servers(self) -> list:
        return [self.plain, self.prefill, self.decode, self.both]

    def stop(self) -> None:
        for srv in reversed(self.servers):
            srv.stop()


def _pull_failures(c: Cluster) -> dict[str, float]:
    consumers = (c.decode, c.both)
    return {s.process.name: s.metric("mooncake_vllm:pull_failures_total") for s in consumers}


@pytest.fixture
def pd(cluster, request):
    """The shared cluster; its logs are printed at session end if a test using it failed.

    A pull that fails is recomputed by the cluster's decode, which token equality cannot see: a
    test that is not marked ``provokes_pull_failure`` fails if any consumer's pull failed."""
    before = _pull_failures(cluster)
    yield cluster
    if _failed(request):
        cluster.dump_logs = True
    elif not request.node.get_closest_marker("provokes_pull_failure"):
        after = _pull_failures(cluster)
        if after != before:
            cluster.dump_logs = True
            pytest.fail(f"pulls failed during this test (before {before}, after {after})")


@pytest.fixture
async def http():
    """An HTTP client for the test's servers (``harness.pd.client_session``)."""
    from harness.pd import client_session

    async with client_session() as s:
        yield s


@pytest.fixture
async def start_proxy():
    """``await start_proxy(prefill=[...], decode=[...], **config)`` → the URL of a proxy served
    in the test's event loop (``harness.local_proxy.proxies``); all stop at test end."""
    from harness.local_proxy import proxies

    async with proxies() as start:
        yield start


@pytest.fixture
async def start_fake():
    """``await start_fake(Fake, *args, **options)`` → ``await Fake(*args, **options).start()``, a
    fake backend (``test_proxy_faults``, ``test_proxy_prompt_lists``) stopped at test end."""
    started = []

    async def start(fake_class, *args, **options):
        fake = await fake_class(*args, **options).start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        await fake.stop()
