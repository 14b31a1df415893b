"""The proxy's pure parts: request rewriting, validation, routing and health, the command line."""

from __future__ import annotations

import pytest

from mooncake_vllm.proxy import rewrite
from mooncake_vllm.proxy.config import ProxyConfig, normalize_backend_url
from mooncake_vllm.proxy.routing import BackendPool, Backoff, NoHealthyBackend, Policy
from mooncake_vllm.proxy.server import build_parser, parse_args, startup_warnings

CHAT = rewrite.CHAT_COMPLETIONS_PATH
COMPLETIONS = rewrite.COMPLETIONS_PATH

# ---- rewrite: the two legs ----------------------------------------------------------------------

CLIENT_HANDOFF = {"do_remote_prefill": True, "transfer_id": "forged", "remote_block_ids": [1]}


def test_prefill_leg_asks_for_one_token_and_a_handoff():
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 50,
        "min_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "temperature": 0.5,
        "kv_transfer_params": CLIENT_HANDOFF,
    }
    leg = rewrite.build_prefill_body(body, COMPLETIONS, "abc123")
    assert leg == {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 1,
        "stream": False,
        "n": 1,
        "temperature": 0.5,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": "abc123",
        },
    }
    assert body["max_tokens"] == 50 and body["kv_transfer_params"] is CLIENT_HANDOFF  # unchanged


@pytest.mark.parametrize(
    ("path", "body", "expected_max_completion_tokens"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, 1),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}, 1),
        (COMPLETIONS, {"prompt": "hi"}, None),
        (COMPLETIONS, {"prompt": "hi", "max_completion_tokens": 9}, 1),
    ],
)
def test_prefill_leg_caps_every_token_limit(path, body, expected_max_completion_tokens):
    leg = rewrite.build_prefill_body(body, path, "t")
    assert leg["max_tokens"] == 1
    assert leg.get("max_completion_tokens") == expected_max_completion_tokens


@pytest.mark.parametrize(
    ("path", "extra", "left_out"),
    [
        (COMPLETIONS, {"min_tokens": 4}, ["min_tokens"]),
        (COMPLETIONS, {"logprobs": 3, "logprob_token_ids": [5]}, ["logprobs", "logprob_token_ids"]),
        (COMPLETIONS, {"echo": True}, ["echo"]),
        (COMPLETIONS, {"response_format": {"type": "json_object"}}, ["response_format"]),
        (COMPLETIONS, {"structured_outputs": {"choice": ["a"]}}, ["structured_outputs"]),
        (CHAT, {"logprobs": True, "top_logprobs": 2}, ["logprobs", "top_logprobs"]),
        (CHAT, {"structured_outputs": {"regex": "a+"}}, ["structured_outputs"]),
        # Kept: they shape the prompt (a chat template may render response_format and tools)
        # or vLLM checks them up front.
        (CHAT, {"response_format": {"type": "json_object"}}, []),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required"}, []),
        (COMPLETIONS, {"logit_bias": {"5": 2.0}, "seed": 3, "stop": ["x"], "ignore_eos": True,
                       "add_special_tokens": False, "truncate_prompt_tokens": 9}, []),
        # Without a stream, stream_options reach the prefill, which refuses them as plain does.
        (COMPLETIONS, {"stream_options": {"include_usage": True}}, []),
    ],
)  # fmt: skip
def test_prefill_leg_leaves_out_what_only_concerns_the_generated_tokens(path, extra, left_out):
    body = {"model": "m", "prompt": "p"} if path == COMPLETIONS else {"messages": [{}]}
    leg = rewrite.build_prefill_body({**body, **extra}, path, "t")
    for key, value in extra.items():
        assert (key not in leg) if key in left_out else (leg[key] == value), key


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (COMPLETIONS, {"prompt": "p"}, None),
        (COMPLETIONS, {"prompt": "p", "echo": True}, None),  # the prompt's text only
        (COMPLETIONS, {"prompt": "p", "logprobs": 2}, None),
        (COMPLETIONS, {"prompt": "p", "echo": True, "logprobs": 0}, "echo"),
        (COMPLETIONS, {"prompt": "p", "prompt_logprobs": 0}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": "p", "prompt_logprobs": None}, None),
        (COMPLETIONS, {"prompt": ["a", "b"], "use_beam_search": True, "n": 2}, "use_beam_search"),
        (COMPLETIONS, {"prompt_embeds": "AAAA"}, "prompt_embeds"),
        (CHAT, {"messages": [{}]}, None),
        (CHAT, {"messages": [{}], "echo": True}, "echo"),  # vLLM: prompt logprobs top_logprobs=0
        (CHAT, {"messages": [{}], "echo": True, "top_logprobs": None}, None),
        (CHAT, {"messages": [{}], "prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_requests_whose_decode_reads_no_transferred_kv_go_to_the_decode_alone(path, body, field):
    assert rewrite.served_by_decode_alone(body, path) == field


def test_transfer_ids_are_fresh():
    assert rewrite.new_transfer_id() != rewrite.new_transfer_id()


def test_decode_leg_carries_exactly_the_prefill_handoff_and_the_client_options():
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 20,
        "stream": True,
        "n": 2,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": CLIENT_HANDOFF,
    }
    handoff = {"do_remote_prefill": True, "transfer_id": "real", "remote_block_ids": [7, 8]}
    leg = rewrite.build_decode_body(body, handoff)
    assert leg == {**body, "kv_transfer_params": handoff}
    assert leg["kv_transfer_params"] is handoff


def test_decode_leg_without_handoff_drops_the_client_params():
    leg = rewrite.build_decode_body({"prompt": "x", "kv_transfer_params": CLIENT_HANDOFF}, None)
    assert leg == {"prompt": "x"}


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"choices": [], "kv_transfer_params": {"transfer_id": "t"}}, {"transfer_id": "t"}),
        ({"choices": [], "kv_transfer_params": None}, None),
        ({"choices": []}, None),
        ({"kv_transfer_params": "garbage"}, None),
        ([1, 2], None),
    ],
)
def test_handoff_is_read_from_the_top_level_of_the_prefill_answer(answer, expected):
    assert rewrite.handoff_from_prefill(answer) == expected


# ---- rewrite: validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (COMPLETIONS, {"prompt": "text"}),
        (COMPLETIONS, {"prompt": ["a", "b"]}),
        (COMPLETIONS, {"prompt": [1, 2, 3]}),
        (COMPLETIONS, {"prompt": [[1, 2], [3]]}),
        (COMPLETIONS, {"prompt": "x", "max_tokens": None, "n": None, "stream": None}),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0, "echo": True}),  # the prompt alone
        (COMPLETIONS, {"prompt_embeds": "AAAA"}),
        (
            CHAT,
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 4,
                "stream": True,
                "n": 2,
            },
        ),
    ],
)
def test_valid_bodies_pass(path, body):
    rewrite.validate_body(body, path)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {}, "prompt"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": ["a", 1]}, "prompt"),
        (COMPLETIONS, {"prompt": [[1], []]}, "prompt"),
        (COMPLETIONS, {"prompt": [True, False]}, "prompt"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": ["hi"]}, "messages"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": [{}], "max_tokens": 0, "echo": True}, "max_tokens"),
        (COMPLETIONS, {"prompt": None}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "max_tokens"),
        (CHAT, {"messages": [{}], "max_completion_tokens": -1}, "max_completion_tokens"),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
        (COMPLETIONS, {"prompt": "x", "n": 1.5}, "n"),
        (COMPLETIONS, {"prompt": "x", "model": 3}, "model"),
    ],
)
def test_invalid_bodies_name_the_field(path, body, param):
    with pytest.raises(rewrite.InvalidRequest) as info:
        rewrite.validate_body(body, path)
    assert info.value.param == param
    assert param in info.value.message


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"n": NaN}'])
def test_parse_body_refuses_anything_but_a_json_object(raw):
    with pytest.raises(rewrite.InvalidRequest) as info:
        rewrite.parse_body(raw)
    assert info.value.param is None


# ---- rewrite: headers and backend errors ---------------------------------------------------------


@pytest.mark.parametrize(
    ("client_auth", "forward", "env_key", "expected"),
    [
        ("Bearer client", True, None, "Bearer client"),
        ("Bearer client", True, "envkey", "Bearer client"),
        (None, True, "envkey", "Bearer envkey"),
        ("Bearer proxy-key", False, "envkey", "Bearer envkey"),
        ("Bearer proxy-key", False, None, None),
        (None, True, None, None),
    ],
)
def test_backend_authorization(client_auth, forward, env_key, expected):
    for trusted in (True, False):
        headers = rewrite.backend_headers(
            request_id="rid",
            client_authorization=client_auth,
            forward_client_authorization=forward,
            env_api_key=env_key,
            backend_trusted=trusted,
        )
        # An untrusted backend (discovered, record not verified) gets no key of any kind.
        assert headers.get("Authorization") == (expected if trusted else None)
        assert headers["X-Request-Id"] == "rid"


@pytest.mark.parametrize(
    ("client_value", "kept"),
    [("req-42", True), ("a" * 129, False), ("bad id\n", False), ("", False), (None, False)],
)
def test_request_id(client_value, kept):
    rid = rewrite.request_id_from(client_value)
    assert (rid == client_value) is kept
    assert rid


def test_backend_error_bodies():
    openai_shaped = b'{"error": {"message": "too long", "type": "BadRequestError", "code": 400}}'
    assert rewrite.backend_error_body("decode", 400, openai_shaped)["error"]["message"] == (
        "too long"
    )
    old_vllm = b'{"object": "error", "message": "bad prompt", "type": "BadRequestError"}'
    wrapped = rewrite.backend_error_body("prefill", 400, old_vllm)["error"]
    assert wrapped["message"] == "prefill backend answered HTTP 400: bad prompt"
    assert wrapped["type"] == "BadRequestError"
    text = rewrite.backend_error_body("decode", 500, b"Internal Server Error")["error"]
    assert text["message"] == "decode backend answered HTTP 500: Internal Server Error"
    assert text["type"] == "backend_error"


# ---- routing ------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _pool(policy=Policy.ROUND_ROBIN, n=3, clock=None):
    return BackendPool(
        "prefill", [f"http://h{i}:1" for i in range(n)], policy, clock=clock or FakeClock()
    )


def _urls(backends):
    return [b.url.removeprefix("http://").removesuffix(":1") for b in backends]


def test_round_robin_cycles_in_configured_order_and_skips_ejected():
    pool = _pool()
    assert _urls(pool.pick() for _ in range(4)) == ["h0", "h1", "h2", "h0"]
    pool.eject(pool.backends[2], "refused")
    assert _urls(pool.pick() for _ in range(4)) == ["h1", "h0", "h1", "h0"]


def test_pick_excludes_backends_already_tried():
    pool = _pool(n=2)
    first = pool.pick()
    assert pool.pick(exclude=[first]) is not first
    with pytest.raises(NoHealthyBackend, match="no healthy prefill backend"):
        pool.pick(exclude=pool.backends)


def test_least_outstanding_takes_the_idlest_backend_and_rotates_ties():
    pool = _pool(Policy.LEAST_OUTSTANDING)
    h0, h1, h2 = pool.backends
    for backend, count in ((h0, 2), (h1, 0), (h2, 1)):
        for _ in range(count):
            pool.begin(backend)
    assert pool.pick() is h1
    pool.begin(h1)
    pool.begin(h1)  # h0=2, h1=2, h2=1
    assert pool.pick() is h2
    pool.end(h0)
    pool.end(h1)  # h0=1, h1=1, h2=1: a tie, taken round robin after h2
    assert _urls([pool.pick(), pool.pick(), pool.pick()]) == ["h0", "h1", "h2"]


def test_in_flight_never_goes_negative():
    pool = _pool(n=1)
    pool.end(pool.backends[0])
    assert pool.backends[0].in_flight == 0


def test_a_prefills_expected_wait_is_its_bytes_in_flight_at_its_time_per_byte():
    (b,) = _pool(n=1).backends
    b.bytes_in_flight = 1000
    assert b.expected_wait_s() == 0.0  # nothing known yet
    b.record_prefill(took_s=2.0, bytes_in_flight=4000)  # it shared the prefill: 0.5 ms a byte
    b.bytes_in_flight = 10_000  # one long prompt or many short ones
    assert b.expected_wait_s() == pytest.approx(5.0)
    b.record_prefill(took_s=1.5, bytes_in_flight=1000)  # an average: each answer moves it a fifth
    assert b.prefill_s_per_byte == pytest.approx(0.0005 + 0.2 * (0.0015 - 0.0005))
    b.bytes_in_flight = 0
    assert b.expected_wait_s() == 0.0


def test_no_healthy_backend_when_all_are_ejected():
    pool = _pool(n=2)
    for b in pool.backends:
        assert pool.eject(b, "refused") is True
    assert not pool.any_healthy()
    with pytest.raises(NoHealthyBackend) as info:
        pool.pick()
    assert info.value.role == "prefill"


def test_ejected_backend_is_reprobed_with_exponential_backoff():
    clock = FakeClock()
    pool = _pool(n=1, clock=clock)
    (backend,) = pool.backends
    assert pool.due_for_probe() == [backend]  # probed at startup

    start_s = clock.now_s
    assert pool.eject(backend, "connection refused") is True
    # A second request that was already in flight fails too: no second ejection, same schedule.
    assert pool.eject(backend, "connection refused") is False

    probe_times = []
    for _ in range(7):
        clock.now_s += pool.seconds_until_next_probe()
        assert pool.due_for_probe() == [backend]
        probe_times.append(clock.now_s - start_s)
        assert pool.probe_failed(backend, "still down") is False
    assert probe_times == [1, 3, 7, 15, 31, 61, 91]  # waits 1, 2, 4, 8, 16, 30, 30

    clock.now_s += pool.seconds_until_next_probe()
    assert pool.probe_ok(backend) is True
    assert backend.healthy and backend.consecutive_failures == 0 and backend.last_error is None
    assert pool.pick() is backend
    assert pool.seconds_until_next_probe() == pool.probe_interval_s


def test_failed_probe_of_a_healthy_backend_ejects_it():
    clock = FakeClock()
    pool = _pool(n=1, clock=clock)
    (backend,) = pool.backends
    assert pool.probe_failed(backend, "HTTP 503") is True
    assert not backend.healthy
    assert backend.next_probe_at_s == clock.now_s + 1.0


def test_late_probes_eject_a_healthy_backend_only_when_they_repeat():
    clock = FakeClock()
    pool = _pool(n=1, clock=clock)
    (backend,) = pool.backends
    # A saturated server answers /health late but still serves: it stays in rotation...
    assert pool.probe_timed_out(backend, "late") is False
    assert pool.probe_timed_out(backend, "late") is False
    assert backend.healthy and pool.pick() is backend
    assert pool.seconds_until_next_probe() == pool.probe_interval_s
    # ...an answer in time clears the count...
    assert pool.probe_ok(backend) is False
    assert pool.probe_timed_out(backend, "late") is False
    assert pool.probe_timed_out(backend, "late") is False
    # ...and only the third late probe in a row ejects it; then it backs off like any failure.
    assert pool.probe_timed_out(backend, "late") is True
    assert not backend.healthy
    assert backend.next_probe_at_s == clock.now_s + 1.0
    assert pool.probe_timed_out(backend, "late") is False
    assert backend.next_probe_at_s == clock.now_s + 2.0


@pytest.mark.parametrize(
    ("failures", "delay_s"), [(0, 1), (1, 1), (2, 2), (5, 16), (6, 30), (5000, 30)]
)
def test_backoff_delay(failures, delay_s):
    assert Backoff(initial_s=1.0, max_s=30.0).delay_s(failures) == delay_s


# ---- configuration and command line -------------------------------------------------------------


def test_help_lists_every_flag():
    text = build_parser().format_help()
    for flag in (
        "--prefill",
        "--decode",
        "--host",
        "--port",
        "--policy",
        "--api-key",
        "--timeout-s",
        "--prefill-timeout-s",
        "--connect-timeout-s",
        "--max-body-bytes",
        "--log-level",
        "round_robin",
        "least_outstanding",
        "prefix",
        "--server",
        "granian",
        "uvicorn",
        "hypercorn",
        "--api-key-file",
        "--api-key-env",
        "--protect-metrics",
        "--protect-health",
        "--client-max-concurrency",
        "--client-rate",
        "--client-burst",
        "--auth-secret-file",
        "--auth-secret-env",
        "--discover-user",
        "--discover-password-file",
        "--discover-password-env",
        "--discover-token-file",
        "--discover-token-env",
        "--discover-ca-file",
        "--discover-cert-file",
        "--discover-key-file",
    ):
        assert flag in text


def test_defaults_bind_loopback():
    cfg = parse_args(["--prefill", "http://127.0.0.1:8100/", "--decode", "http://127.0.0.1:8200"])
    assert cfg.host == "127.0.0.1" and cfg.port == 8000
    assert cfg.prefill == ["http://127.0.0.1:8100"]
    assert cfg.policy is Policy.ROUND_ROBIN
    assert (cfg.timeout_s, cfg.prefill_timeout_s, cfg.connect_timeout_s) == (300, 120, 5)
    assert cfg.max_body_bytes == 10 * 1024 * 1024


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--prefill", "localhost:8100", "--decode", "http://h:1"], "--prefill"),
        (["--prefill", "http://h:1", "--decode", "ftp://h:2"], "--decode"),
        (["--prefill", "http://h:1", "--decode", "http://h:2/v1"], "--decode"),
        (["--prefill", "http://h:99999", "--decode", "http://h:2"], "--prefill"),
        (
            ["--prefill", "http://h:1", "--prefill", "http://h:1/", "--decode", "http://h:2"],
            "--prefill: listed more than once",
        ),
        (["--prefill", "http://h:1", "--decode", "http://h:2", "--timeout-s", "0"], "--timeout-s"),
    ],
)
def test_bad_flags_exit_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "normalized"),
    [
        ("http://127.0.0.1:8100", "http://127.0.0.1:8100"),
        ("https://example.org/", "https://example.org"),
        ("http://[::1]:8000", "http://[::1]:8000"),
    ],
)
def test_backend_url_normalization(url, normalized):
    assert normalize_backend_url(url) == normalized


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="bogus"):
        ProxyConfig(prefill=["http://h:1"], decode=["http://h:2"], bogus=1)


# ---- the decode body passed through -------------------------------------------------------------

HANDOFF = {"transfer_id": "t1", "remote_block_ids": [0, 1]}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "caf\\u00e9 \xc3\xa9", "max_tokens": 3, "temperature": 0.7}',
        b'{"prompt":[1,2,3],"stream":true}  \n',
        b'{"messages": [{"role": "user", "content": "}"}], "n": 1}',
        b'{"prompt": "x", "kv_transfer_params": {"transfer_id": "forged"}}',  # rebuilt
        b'{"prompt": "x", "big": 123456789012345678901234567890}',
    ],
)
@pytest.mark.parametrize("handoff", [HANDOFF, None])
def test_decode_body_bytes_equals_the_built_decode_body(raw, handoff):
    body = rewrite.parse_body(raw)
    sent = rewrite.decode_body_bytes(raw, body, handoff)
    assert rewrite.parse_body(sent) == rewrite.build_decode_body(body, handoff)
    if "kv_transfer_params" not in body:
        assert sent.startswith(raw.rstrip()[:-1])  # the client's bytes, not re-serialised


def test_server_flag_and_startup_line():
    from mooncake_vllm.proxy.http_servers import DEFAULT_HTTP_SERVER, HttpServer
    from mooncake_vllm.proxy.server import startup_line

    assert parse_args([]).server is DEFAULT_HTTP_SERVER
    cfg = parse_args(["--server", "hypercorn", "--host", "::1", "--port", "9"])
    assert cfg.server is HttpServer.HYPERCORN
    assert startup_line(cfg) == (
        "serving on http://[::1]:9 (hypercorn), prefill http://localhost:8100, "
        "decode http://localhost:8200, policy round_robin"
    )


def test_pool_mode_prefill_asks_for_no_handoff_and_drops_the_clients():
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 9, "stream": True,
            "kv_transfer_params": CLIENT_HANDOFF}  # fmt: skip
    leg = rewrite.build_prefill_body(body, COMPLETIONS, None)
    assert leg == {"model": "tiny", "prompt": "hello", "max_tokens": 1, "stream": False, "n": 1}
    assert rewrite.build_decode_body(body, None) == {
        "model": "tiny", "prompt": "hello", "max_tokens": 9, "stream": True,
    }  # fmt: skip


def test_mode_flag():
    args = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert parse_args(args).mode == "p2p"
    assert parse_args([*args, "--mode", "pool"]).mode == "pool"
    with pytest.raises(SystemExit):
        parse_args([*args, "--mode", "push"])


# ---- clients' keys, limits, the shared secret, the store's credentials ---------------------------

STATIC = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


def test_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("  first-key \n\nsecond-key\n")
    assert parse_args([*STATIC, "--api-key-file", str(keys)]).api_keys() == (
        "first-key",
        "second-key",
    )
    monkeypatch.setenv("PROXY_KEY", "env-key\n")
    cfg = parse_args([*STATIC, "--api-key-env", "PROXY_KEY"])
    assert cfg.api_keys() == ("env-key",) and startup_warnings(cfg) == []
    assert parse_args(STATIC).api_keys() == ()


def test_the_key_on_the_command_line_still_works_with_a_warning():
    cfg = parse_args([*STATIC, "--api-key", "k"])
    assert cfg.api_keys() == ("k",)
    [warning] = startup_warnings(cfg)
    assert "--api-key" in warning and "--api-key-file" in warning and "ps" in warning


def test_discovery_without_a_secret_warns_that_discovered_backends_get_no_key(monkeypatch):
    [warning] = startup_warnings(parse_args(["--discover", "etcd://h:1"]))
    assert "--auth-secret-file" in warning and "no Authorization" in warning
    monkeypatch.setenv("SECRET", "s" * 32)
    cfg = parse_args(["--discover", "etcd://h:1", "--auth-secret-env", "SECRET"])
    assert startup_warnings(cfg) == [] and cfg.auth_keys() == (b"s" * 32,)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--api-key", "a", "--api-key-env", "K"], "give only one of --api-key and --api-key-env"),
        (["--api-key-file", "/nonexistent/keys"], "--api-key-file '/nonexistent/keys' cannot be"),
        (["--api-key-file", "EMPTY"], "holds no key"),
        (["--api-key-env", "UNSET_PROXY_KEY"], "--api-key-env 'UNSET_PROXY_KEY': the environment"),
        (["--protect-metrics"], "--protect-metrics needs the API key"),
        (["--protect-health", "--protect-metrics"], "--protect-metrics and --protect-health"),
        (["--client-burst", "3"], "--client-burst needs --client-rate"),
        (["--client-rate", "0"], "--client-rate"),
        (["--client-max-concurrency", "0"], "--client-max-concurrency"),
        (["--auth-secret-file", "/nonexistent/s"], "--auth-secret-file '/nonexistent/s' cannot"),
        (["--auth-secret-env", "SHORT"], "--auth-secret-env 'SHORT': key 1 has fewer than 16"),
        (["--discover-user", "u"], "--discover-user: credentials for --discover's store, but no"),
        (["--discover", "http://h:1/metadata", "--discover-token-env", "UNSET_TOKEN"],
         "--discover-token-env: the environment variable is not set"),
        (["--discover", "etcd://h:1", "--discover-password-env", "SHORT"],
         "set --discover-user"),
        (["--discover", "etcd://h:1", "--discover-token-env", "SHORT"],
         "--discover-token-file/--discover-token-env are for the http metadata server"),
    ],
)  # fmt: skip
def test_bad_security_flags_exit_naming_the_flag_and_the_fix(
    argv, fragment, capsys, tmp_path, monkeypatch
):
    monkeypatch.setenv("SHORT", "too-short")
    monkeypatch.delenv("UNSET_PROXY_KEY", raising=False)
    monkeypatch.delenv("UNSET_TOKEN", raising=False)
    (tmp_path / "EMPTY").write_text("\n \n")
    argv = [str(tmp_path / a) if a == "EMPTY" else a for a in argv]
    if "--discover" not in argv:
        argv = [*STATIC, *argv]
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err
