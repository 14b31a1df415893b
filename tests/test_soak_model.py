"""The trace soak's pure half: per-loop salts, which answers are checked against plain, process
labels, samples turned into series, the slope and noise that say whether a series is flat, and
the report (rows, series file, plot) drawn from synthetic samples."""

from __future__ import annotations

import json
import math
import random

import matplotlib
import pytest

from benchmarks import soak_trace
from benchmarks.soak_model import (
    METRICS,
    checked_against_plain,
    flat_floor,
    loop_seed,
    process_label,
    series,
    trend,
    unique_labels,
)
from benchmarks.trace_model import Scale, TraceRequest, prompt_for


def test_loop_zero_plays_the_trace_as_the_replay_does_and_later_loops_are_fresh():
    assert loop_seed(7, 0) == 7
    seeds = [loop_seed(7, k) for k in range(50)]
    assert len(set(seeds)) == 50
    # Never the replay's warm-up seed (seed + 1).
    assert 8 not in seeds
    with pytest.raises(ValueError, match="loop -1"):
        loop_seed(0, -1)


def test_a_salted_loop_keeps_the_trace_shape_with_new_tokens():
    scale = Scale(4, 0.05, 32)
    a = TraceRequest(0, 1000, 10, (0, 5))
    b = TraceRequest(0, 700, 10, (0, 6))  # shares block 0 (the system prompt) with a
    loop0 = [prompt_for(r, scale, 2048, loop_seed(0, 0)) for r in (a, b)]
    loop1 = [prompt_for(r, scale, 2048, loop_seed(0, 1)) for r in (a, b)]
    assert [len(p) for p in loop0] == [len(p) for p in loop1] == [250, 175]
    block = scale.block_tokens
    assert loop0[0][:block] == loop0[1][:block]  # the shared block, within a loop
    assert loop1[0][:block] == loop1[1][:block]
    assert loop0[0][:block] != loop1[0][:block]  # and new content in the next loop


@pytest.mark.parametrize(
    ("loop", "every", "checked"),
    [
        (0, 10, list(range(20))),  # all of loop 0
        (0, 0, list(range(20))),
        (1, 10, [9, 19]),
        (2, 10, [8, 18]),
        (1, 0, []),  # loop 0 only
        (3, 1, list(range(20))),  # every answer
    ],
)
def test_which_answers_are_checked(loop, every, checked):
    assert [i for i in range(20) if checked_against_plain(loop, i, every)] == checked


def test_over_every_loops_each_request_is_checked_once():
    every = 4
    for i in range(12):
        assert sum(checked_against_plain(k, i, every) for k in range(1, 1 + every)) == 1
    with pytest.raises(ValueError, match="every -1"):
        checked_against_plain(1, 0, -1)


@pytest.mark.parametrize(
    ("role", "name", "cmdline", "label"),
    [
        ("decode", "VLLM::EngineCore", ["VLLM::EngineCore"], "decode/EngineCore"),
        ("plain", "python", ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--x"],
         "plain/api_server"),
        ("prefill", "python", ["/v/bin/python", "-m", "mooncake_vllm.p2p.leases.process", "4"],
         "prefill/leases.process"),
        ("prefill", "python", ["/v/bin/python", "-m", "mooncake_vllm.p2p.bootstrap", "4", "1"],
         "prefill/bootstrap"),
        ("proxy", "python", ["/v/bin/python", "/r/proxy/proxy_server.py", "--prefill", "u"],
         "proxy/proxy_server"),
        ("decode", "python", ["/v/bin/python", "-B", "-c",
                              "from multiprocessing.resource_tracker import main;main(31)"],
         "decode/resource_tracker"),
        ("prefill", "python3.11", ["python3.11", "-c", "print(1)"], "prefill/python3.11"),
        ("decode", "", [], "decode/unknown"),
    ],
)  # fmt: skip
def test_process_labels(role, name, cmdline, label):
    assert process_label(role, name, cmdline) == label


def test_repeated_labels_are_numbered():
    assert unique_labels(["a/x", "a/y", "a/x", "a/x"]) == ["a/x", "a/y", "a/x#2", "a/x#3"]


def test_samples_become_one_series_per_metric_and_process():
    samples = [
        {"t_s": 0, "procs": {"d/api": {"rss_mib": 10, "fds": 5}},
         "engine": {"prefill": {"held_leases": 0}, "decode": {"pulls_per_min": None}}},
        {"t_s": 60, "procs": {"d/api": {"rss_mib": 11, "fds": 5}, "d/new": {"rss_mib": 1}},
         "engine": {"prefill": {"held_leases": 2}, "decode": {"pulls_per_min": 30}}},
        {"t_s": 120, "procs": {}, "engine": {}},  # a reading where nothing answered
    ]  # fmt: skip
    assert series(samples) == {
        ("rss_mib", "d/api"): [(0.0, 10.0), (60.0, 11.0)],
        ("fds", "d/api"): [(0.0, 5.0), (60.0, 5.0)],
        ("rss_mib", "d/new"): [(60.0, 1.0)],
        ("held_leases", "prefill"): [(0.0, 0.0), (60.0, 2.0)],
        ("pulls_per_min", "decode"): [(60.0, 30.0)],
    }


def minutes(values):
    return [(60.0 * i, v) for i, v in enumerate(values)]


def test_a_constant_series_is_flat_with_no_noise():
    t = trend(minutes([42] * 10), warmup_s=0)
    assert (t.points, t.slope_per_h, t.noise, t.mean) == (10, 0.0, 0.0, 42.0)
    assert t.flat()


def test_a_leak_is_its_slope_per_hour_and_is_not_flat():
    # 2 MiB a minute, after a warm-up that jumps: 120 MiB an hour, no noise.
    values = [0, 500, 900] + [1000 + 2 * i for i in range(3, 30)]
    t = trend(minutes(values), warmup_s=180)
    assert t.points == 27 and t.first == 1006 and t.last == 1058
    assert t.slope_per_h == pytest.approx(120)
    assert t.noise == pytest.approx(0, abs=1e-9)
    assert t.span_h == pytest.approx(26 / 60)
    assert not t.flat()


def test_noise_is_the_residual_standard_deviation_around_the_line():
    rng = random.Random(1)
    values = [500 + rng.gauss(0, 3) for _ in range(60)]
    t = trend(minutes(values), warmup_s=0)
    assert abs(t.slope_per_h) < 10
    assert t.noise == pytest.approx(3, rel=0.3)
    assert t.flat()
    # Alternating ±1 around a flat line: slope ~0, noise ~1 (ddof 2 makes it a little over).
    t = trend(minutes([10 + (-1) ** i for i in range(20)]), warmup_s=0)
    assert t.noise == pytest.approx(math.sqrt(20 / 18), rel=0.01)


def test_a_count_that_steps_once_is_flat_at_its_resolution():
    t = trend(minutes([40] * 10 + [41] * 10), warmup_s=0)
    assert 1 < t.drift < 1.5  # a line through one step rises by more than the step
    assert not t.flat()  # a trend against no noise ...
    assert t.flat(floor=flat_floor("fds", t.mean))  # ... but not a leak of fds
    # One fd every 10 minutes for an hour is one.
    t = trend(minutes([40 + i // 10 for i in range(60)]), warmup_s=0)
    assert t.drift > 5 and not t.flat(floor=flat_floor("fds", t.mean))


@pytest.mark.parametrize(
    ("metric", "mean", "floor"),
    [("fds", 300, 2), ("threads", 5, 2), ("rss_mib", 1800, 18), ("rss_mib", 10, 0.1),
     ("pull_failures", 0, 0), ("kv_usage_%", 50, 0)],
)  # fmt: skip
def test_flat_floors(metric, mean, floor):
    assert flat_floor(metric, mean) == pytest.approx(floor)


def test_every_metric_has_a_unit_and_floors():
    for unit, units, share in METRICS.values():
        assert unit and units >= 0 and 0 <= share < 1


@pytest.mark.parametrize(
    ("points", "warmup_s"),
    [
        ([], 0),
        (minutes([1, 2]), 0),  # two points: a line, but no noise to judge it by
        (minutes([1, 2, 3, 4]), 120),  # two left after the warm-up
        ([(300.0, 1.0), (300.0, 2.0), (300.0, 3.0)], 0),  # one instant
    ],
)
def test_too_few_points_after_the_warm_up_give_no_trend(points, warmup_s):
    assert trend(points, warmup_s) is None


def test_the_report_of_synthetic_samples(tmp_path):
    """No servers: the rows, the series file and the plot of a leaking and a flat process."""
    samples = [
        {"t_s": 60.0 * i,
         "procs": {"d/Worker": {"rss_mib": 1000 + 2 * i, "fds": 100}, "p/api": {"rss_mib": 600}},
         "engine": {"prefill": {"held_leases": 0}, "decode": {"pulls": 5.0 * i}}}
        for i in range(12)
    ]  # fmt: skip
    rows = {(r["metric"], r["process"]): r for r in soak_trace.trend_rows(samples, warmup_s=120)}
    assert set(rows) == {("rss_mib", "d/Worker"), ("fds", "d/Worker"), ("rss_mib", "p/api"),
                         ("held_leases", "prefill")}  # cumulative pulls: no trend  # fmt: skip
    leak = rows["rss_mib", "d/Worker"]
    assert (leak["points"], leak["slope_per_h"], leak["flat"]) == (10, 120.0, "NO")
    assert rows["rss_mib", "p/api"]["flat"] == rows["fds", "d/Worker"]["flat"] == "yes"
    written = json.loads(soak_trace.write_series(tmp_path / "s.json", samples).read_text())
    assert written["rss_mib|d/Worker"][-1] == [660.0, 1022.0]
    matplotlib.use("Agg")
    soak_trace.plot(samples, 120, "test")(tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


# ---- the request path, against fake OpenAI servers ----------------------------------------------


def _fake_openai(offset: int):
    """A streaming /v1/completions that answers ``max_tokens`` ids computed from the prompt (plus
    ``offset``: a server that answers differently), in two events, as vLLM streams them."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["return_token_ids"] and body["temperature"] == 0
        ids = [(sum(body["prompt"]) + k + offset) % 997 for k in range(body["max_tokens"])]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in (ids[:1], ids[1:]):
            event = {"choices": [{"index": 0, "text": "x", "token_ids": part}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.mark.parametrize("proxy_offset", [0, 1])
async def test_soak_sends_every_request_and_checks_the_chosen_ones_against_plain(proxy_offset):
    """``soak_trace.soak`` end to end on fakes (its request path had no test: a signature drift in
    ``trace.one_request`` broke ``make soak`` unseen): every request of every loop is sent and
    timed, loop 0's answers and every ``check_every``-th after are compared with plain's, and a
    proxy answering differently shows as unequal, not as an error."""
    from types import SimpleNamespace

    from harness.local_proxy import start_app

    runners = []
    try:
        urls = {}
        for name, offset in (("proxy", proxy_offset), ("plain", 0)):
            runner, port = await start_app(_fake_openai(offset))
            runners.append(runner)
            urls[name] = SimpleNamespace(url=f"http://127.0.0.1:{port}")
        stack = SimpleNamespace(**urls)
        # Two conversations (their first two hash ids), three requests, 50 ms apart.
        trace = [TraceRequest(0, 1024, 40, (0, 1)), TraceRequest(50, 1024, 40, (0, 2)),
                 TraceRequest(100, 1536, 40, (0, 1, 3))]  # fmt: skip
        scale = Scale(length_div=8, time_mul=1.0, max_output_tokens=4)
        records = await soak_trace.soak(stack, "m", trace, scale, duration_s=0.42,
                                        loop_gap_s=0.05, check_every=2, seed=3)  # fmt: skip
    finally:
        for runner in runners:
            await runner.cleanup()
    assert len(records) == 9  # three loops of 0.15 s in 0.42 s, three requests each
    assert not [r for r in records if "error" in r]
    assert {r["loop"] for r in records} == {0, 1, 2}
    assert all(r["ttft_ms"] <= r["latency_ms"] for r in records)
    checked = [r for r in records if "equal" in r]
    expected = [r for r in records if checked_against_plain(r["loop"], r["index"], 2)]
    assert checked == expected and len(checked) > 3
    assert all(r["equal"] == (proxy_offset == 0) for r in checked)
