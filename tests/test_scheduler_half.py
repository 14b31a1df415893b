"""The scheduler half in-process, with stub requests and blocks shaped like vLLM's: what it claims,
which blocks it plans to fill, which handoffs it rejects, and what a finished prefill hands over
(no vLLM engine, no servers; the producer's side channel binds a loopback port)."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import zmq
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from harness.servers import free_port
from mooncake_vllm.core.identity import compat_hash, engine_compat_hash, engine_kv_layout
from mooncake_vllm.core.loads import MooncakeWorkerMeta
from mooncake_vllm.core.planning import producer_rank_for
from mooncake_vllm.core.settings import ConfigError
from mooncake_vllm.p2p import protocol
from mooncake_vllm.p2p.config import load_settings, resolve
from mooncake_vllm.p2p.leases.client import MAX_READERS, RankLayout
from mooncake_vllm.p2p.leases.process import LayerDone, encode
from mooncake_vllm.p2p.local_channels import layers_endpoint
from mooncake_vllm.p2p.scheduler import SchedulerHalf
from mooncake_vllm.p2p.side_channel import CallCancelled, SideChannelClient

BLOCK = 128
HASH = "c" * 64
STEP = SimpleNamespace(total_num_scheduled_tokens=1, finished_req_ids=set())  # a busy step
# What a consumer's pending acquire names of the 300-token prompts (``request``) below.
PROMPT_DIGEST = protocol.prompt_digest(list(range(300)))


def pending_acquire(tid: str, owner: bytes, wait_ms: int, layers_ok: bool = False):
    """A pending handoff's acquire of a 300-token prompt, as a consumer's worker sends it."""
    return protocol.Acquire(
        tid, [], owner, 1, "", wait_ms=wait_ms, layers_ok=layers_ok, prompt_digest=PROMPT_DIGEST
    )


def request(req_id: str, prompt_len: int, params: dict | None, **kw) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params=params,
        num_prompt_tokens=prompt_len,
        prompt_token_ids=kw.get("tokens", list(range(prompt_len))),
        status=kw.get("status", RequestStatus.WAITING),
        num_computed_tokens=kw.get("computed", 0),
    )


class Blocks:
    """vLLM's KVCacheBlocks as the connector reads it: one group; cached blocks carry a hash."""

    def __init__(self, block_ids: list[int], cached: int = 0):
        self.blocks = (
            [
                SimpleNamespace(block_id=b, block_hash=f"h{b}" if i < cached else None)
                for i, b in enumerate(block_ids)
            ],
        )

    def get_unhashed_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]


def handoff_params(prompt_len: int, transfer_id: str = "t-1", **overrides) -> dict:
    n = -(-prompt_len // BLOCK)
    return {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "producer_engine_id": "prefill",
        "side_channel_host": "127.0.0.1",
        "side_channel_ports": [16000],
        "producer_tp_size": 1,
        "remote_block_ids": list(range(1, n + 1)),
        "prompt_len": prompt_len,
        "block_size": BLOCK,
        "compat_hash": HASH,
        **overrides,
    }


@pytest.fixture
def consumer():
    settings = load_settings({"decode_url": "127.0.0.1:17000"}, env={})
    half = SchedulerHalf(resolve(settings, "kv_consumer", "decode", 1), BLOCK, HASH)
    yield half
    half.shutdown()


@pytest.fixture
def producer():
    port = free_port_run(2)  # the side channel binds port + 1
    settings = load_settings({"prefill_url": f"127.0.0.1:{port}", "bootstrap_port": 0}, env={})
    half = SchedulerHalf(resolve(settings, "kv_producer", "prefill", 1), BLOCK, HASH)
    half.set_layouts(
        {0: RankLayout("127.0.0.1:1", [protocol.MemSegment(0, 1000, 1000)], worker_pid=0)}
    )
    yield half
    half.shutdown()


def plan(half: SchedulerHalf, req, blocks: Blocks, computed: int = 0):
    """vLLM's call order for one waiting request, then the step's metadata."""
    count, is_async = half.get_num_new_matched_tokens(req, computed)
    half.update_state_after_alloc(req, blocks, count)
    return count, is_async, half.build_connector_meta(STEP).loads


def test_a_prompt_without_local_hits_is_claimed_whole_and_every_block_is_pulled(consumer):
    req = request("r1", 300, handoff_params(300))
    count, is_async, loads = plan(consumer, req, Blocks([10, 11, 12]))
    assert (count, is_async) == (300, True)
    (load,) = loads
    assert (load.remote_block_ids, load.local_block_ids, load.error) == (
        [1, 2, 3],
        [10, 11, 12],
        None,
    )
    # Called again once the load is done: nothing new.
    assert consumer.get_num_new_matched_tokens(req, 300) == (0, False)
    consumer.update_state_after_alloc(req, Blocks([10, 11, 12]), 0)
    assert consumer.build_connector_meta(STEP).loads == []


def test_a_partial_local_prefix_hit_pulls_only_the_missing_blocks(consumer):
    req = request("r1", 300, handoff_params(300))
    count, _, (load,) = plan(consumer, req, Blocks([10, 11, 12], cached=1), computed=BLOCK)
    assert count == 300 - BLOCK
    # All the producer's blocks, and where the local cache stops: the worker maps tokens.
    assert (load.remote_block_ids, load.local_block_ids) == ([1, 2, 3], [11, 12])
    assert load.first_token == BLOCK


def test_a_full_local_prefix_hit_pulls_nothing_and_only_releases_the_lease(consumer):
    req = request("r1", 256, handoff_params(256))
    count, is_async, (load,) = plan(consumer, req, Blocks([10, 11], cached=2), computed=256)
    assert (count, is_async) == (0, False)
    assert (load.local_block_ids, load.error) == ([], None)
    assert load.handoff.transfer_id == "t-1"  # the worker releases the producer's lease


def loaded(req_ids, failed=()):
    """What vLLM hands ``update_connector_output`` after workers report loads done."""
    return KVConnectorOutput(finished_recving=set(req_ids), failed_recving=set(failed))


# vLLM's names for the children of one n > 1 request (``ParentRequest.get_child_info``).
R1, R2 = "0_cmpl-9-0-1a2b3c4d", "1_cmpl-9-0-1a2b3c4d"


def test_requests_sharing_a_transfer_id_pull_it_once_and_follow_the_first(consumer):
    """vLLM's n > 1 children carry one transfer id: the first pulls; the others ask again while
    it is in flight, then take the local prefix cache, never the lease."""
    _, _, (load,) = plan(consumer, request(R1, 300, handoff_params(300)), Blocks([10, 11, 12]))
    assert load.handoff is not None and load.error is None
    child = request(R2, 300, handoff_params(300))
    assert consumer.get_num_new_matched_tokens(child, 0) == (None, False)  # ask again later
    assert consumer.get_num_new_matched_tokens(child, 256) == (None, False)
    consumer.update_connector_output(loaded([R1]))  # the first's load is done
    assert consumer.get_num_new_matched_tokens(child, 256) == (0, False)  # 256 cached here
    consumer.update_state_after_alloc(child, Blocks([20, 21, 22]), 0)
    assert consumer.build_connector_meta(STEP).loads == []  # no pull, no release: not its lease


def test_requests_following_a_failed_pull_fail_with_it_without_touching_the_lease(consumer):
    plan(consumer, request(R1, 300, handoff_params(300)), Blocks([10, 11, 12]))
    consumer.update_connector_output(loaded([R1], failed=[R1]))
    _, is_async, (load,) = plan(consumer, request(R2, 300, handoff_params(300)), Blocks([20, 21]))
    assert is_async  # claimed, so the worker reports it failed and vLLM's policy decides
    assert load.handoff is None
    assert f"the pull of transfer t-1 this request shares ({R1}) failed" in load.error


def test_a_puller_whose_prompt_is_cached_here_lets_its_followers_go_at_once(consumer):
    req = request(R1, 300, handoff_params(300))
    assert consumer.get_num_new_matched_tokens(req, 300) == (0, False)
    consumer.update_state_after_alloc(req, Blocks([]), 0)  # nothing to pull: no outcome comes
    child = request(R2, 300, handoff_params(300))
    assert consumer.get_num_new_matched_tokens(child, 300) == (0, False)


@pytest.mark.parametrize("settled", [None, "done", "failed"])
@pytest.mark.parametrize(
    ("other_id", "other_tokens"),
    [
        ("cmpl-7-0-5e6f7a8b", None),  # another request, the same prompt
        ("1_cmpl-7-0-5e6f7a8b", None),  # a child of another request
        (R2, list(range(1, 301))),  # a "sibling" of another prompt of the same length
    ],
)
def test_a_transfer_id_used_by_another_request_is_refused_at_once_or_later(
    consumer, settled, other_id, other_tokens
):
    """An orchestrator that sends one transfer_id with two requests (at once, or once the first
    has ended): the second is claimed and refused naming the id, and never touches the lease.
    Only vLLM's n > 1 siblings of one prompt follow the pull."""
    tid = "xfer-3f2b8c1e-9d4a-4e6f-8b1c-2a3d4e5f6a7b"
    plan(consumer, request(R1, 300, handoff_params(300, transfer_id=tid)), Blocks([10, 11, 12]))
    if settled is not None:
        consumer.update_connector_output(loaded([R1], failed=[R1] if settled == "failed" else []))
    kw = {"tokens": other_tokens} if other_tokens else {}
    other = request(other_id, 300, handoff_params(300, transfer_id=tid), **kw)
    _, is_async, (load,) = plan(consumer, other, Blocks([20, 21, 22]))
    assert is_async  # the worker reports it failed: vLLM's policy decides
    assert load.handoff is None  # not even a release: the lease is the first request's
    state = "still pulling" if settled is None else "ended"
    assert load.error == (
        f"transfer_id xfer-3f2b8c1e was used before on this consumer by request {R1} ({state}); "
        "refused (choose a new transfer_id for every request)"
    )


def test_a_handoff_from_another_model_is_rejected_but_its_lease_is_released(consumer):
    params = handoff_params(300, compat_hash="d" * 64)
    _, is_async, (load,) = plan(consumer, request("r1", 300, params), Blocks([10, 11, 12]))
    assert is_async  # still claimed: the worker reports it failed and vLLM's policy decides
    assert "compat hash mismatch" in load.error
    assert load.handoff is not None


def trusting_consumer(trusted: list[str]) -> SchedulerHalf:
    settings = load_settings(
        {"decode_url": "127.0.0.1:17000", "trusted_producers": trusted}, env={}
    )
    return SchedulerHalf(resolve(settings, "kv_consumer", "decode", 1), BLOCK, HASH)


@pytest.mark.parametrize(
    ("trusted", "host", "refused"),
    [
        (["10.0.0.0/8"], "127.0.0.1", True),
        (["10.0.0.0/8"], "10.1.2.3", False),
        (["prefill-0"], "prefill-1", True),
        (["prefill-0", "127.0.0.1"], "127.0.0.1", False),
    ],
)
def test_a_handoff_naming_an_untrusted_producer_is_refused_without_contacting_it(
    trusted, host, refused
):
    half = trusting_consumer(trusted)
    try:
        params = handoff_params(300, side_channel_host=host)
        _, is_async, (load,) = plan(half, request("r1", 300, params), Blocks([10, 11, 12]))
    finally:
        half.shutdown()
    assert is_async  # claimed either way: the worker reports the failure, vLLM's policy decides
    if refused:
        # No handoff for the worker: not even a release goes to a host we do not trust.
        assert load.handoff is None
        assert f"producer {host!r} is not in trusted_producers {trusted}" in load.error
    else:
        assert (load.error, load.handoff.side_channel_host) == (None, host)


def test_a_handoff_without_a_side_channel_is_left_to_the_workers_registry_check():
    # The worker looks the producer up in the registry and checks the record's host there.
    half = trusting_consumer(["10.0.0.0/8"])
    try:
        params = handoff_params(300, side_channel_host="", side_channel_ports=[])
        _, _, (load,) = plan(half, request("r1", 300, params), Blocks([10, 11, 12]))
    finally:
        half.shutdown()
    assert load.error is None and load.handoff is not None


def test_a_request_without_a_handoff_is_not_claimed(consumer):
    assert consumer.get_num_new_matched_tokens(request("r1", 300, None), 0) == (0, False)
    assert consumer.get_num_new_matched_tokens(request("r2", 300, {"x": 1}), 0) == (0, False)


def test_blocks_to_fill_are_pinned_until_the_worker_settles_the_load(consumer):
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK)
    consumer.bind_block_pool(pool)
    blocks = pool.get_new_blocks(3)
    ids = [b.block_id for b in blocks]
    plan(consumer, request("r1", 300, handoff_params(300)), Blocks(ids))
    assert [b.ref_cnt for b in blocks] == [2, 2, 2]
    assert consumer.has_pending_work()  # vLLM keeps stepping even once the request is gone
    consumer.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=MooncakeWorkerMeta(["r1"]))
    )
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert not consumer.has_pending_work()


@pytest.mark.parametrize(
    "status", [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED]
)
def test_a_finished_prefill_hands_over_its_prompt_blocks_and_holds_them(producer, status):
    params = {"do_remote_decode": True}
    req = request("p1", 300, params, status=status, computed=300)
    delay_free, out = producer.request_finished(req, [5, 6, 7, 8])  # 4th: the sampled token's
    assert delay_free
    handoff = protocol.parse_handoff(out)
    assert handoff.remote_block_ids == [5, 6, 7]
    assert (handoff.prompt_len, handoff.block_size, handoff.compat_hash) == (300, BLOCK, HASH)
    stats = producer.get_stats().data
    assert (stats["held_leases"], stats["held_bytes"]) == (1, 3 * 1000)


XFER = "xfer-3f2b8c1e-9d4a-4e6f-8b1c-2a3d4e5f6a7b"  # upstream's orchestrators' form


def test_the_producer_takes_a_clients_id_once_and_makes_its_own_otherwise(producer, caplog):
    # As vLLM's upstream connector, the producer takes the id its client sends (our proxy's 32
    # hex digits under --dispatch concurrent, 'xfer-<uuid4>' of vLLM's upstream orchestrators,
    # any bounded id), and its own 128 random bits when none or an unusable one comes. One it
    # has taken before is refused: nothing is handed over under it.
    good = "0123456789abcdef" * 2
    asked = ["t-9", "t-9", None, good, good, good.upper(), XFER, XFER, "xfer-1", "bad id", 7]
    answers = []
    for i, tid in enumerate(asked):
        params = {"do_remote_decode": True, **({"transfer_id": tid} if tid else {})}
        req = request(f"p{i}", 300, params, status=RequestStatus.FINISHED_STOPPED, computed=300)
        answers.append(producer.request_finished(req, [5, 6, 7]))
    refused = (1, 4, 7, 10)  # used before; and a wrongly typed id (p2p.params)
    assert all(answers[i] == (False, None) for i in refused)
    assert "transfer_id xfer-3f2b8c1e was used before on this producer" in caplog.text
    ids = [protocol.parse_handoff(a[1]).transfer_id for i, a in enumerate(answers)
           if i not in refused]  # fmt: skip
    assert len(set(ids)) == len(ids) and "bad id" not in ids
    assert ids[:6] == ["t-9", ids[1], good, good.upper(), XFER, "xfer-1"]
    assert len(ids) == 7 and len(ids[1]) == len(ids[6]) == 32  # its own, for none or a bad one
    assert all(protocol.is_transfer_id(tid) for tid in ids)
    assert producer.get_stats().data["held_leases"] == len(ids)  # none superseded another


def test_the_producer_answers_params_for_both_conventions(tmp_path):
    port, boot = free_port_run(2), free_port("127.0.0.1")
    settings = load_settings({"prefill_url": f"127.0.0.1:{port}", "bootstrap_port": boot}, env={})
    half = SchedulerHalf(resolve(settings, "kv_producer", "prefill", 1), BLOCK, HASH)
    try:
        half.set_layouts({0: RankLayout("127.0.0.1:1", [protocol.MemSegment(0, 1000, 1000)], 0)})
        req = request("p1", 300, {"do_remote_decode": True, "do_remote_prefill": False,
                                  "transfer_id": XFER},
                      status=RequestStatus.FINISHED_STOPPED, computed=300)  # fmt: skip
        held, params = half.request_finished(req, [5, 6, 7])
        assert held and params["transfer_id"] == XFER
        assert protocol.parse_handoff(params).remote_block_ids == [5, 6, 7]  # ours, NIXL-style
        # ... and upstream's: where the decode finds this engine.
        assert params["remote_engine_id"] == "prefill"
        assert params["remote_bootstrap_addr"] == f"http://127.0.0.1:{boot}"
    finally:
        half.shutdown()


@pytest.mark.parametrize("set_by", [None, "setting", "env"])
def test_a_taken_bootstrap_port_stops_the_start_only_where_it_was_chosen(set_by, caplog):
    """Upstream's default port taken by another producer on the host: this one starts without
    a bootstrap and says so once, its handoffs naming none; a port that was set (the setting,
    or vLLM's variable) and is taken still stops the start."""
    from mooncake_vllm.p2p.bootstrap import BootstrapService
    from mooncake_vllm.p2p.config import BOOTSTRAP_PORT_ENV

    boot = free_port("127.0.0.1")
    other = BootstrapService(producer_cfg_on(free_port_run(2), boot, "other"))
    port = free_port_run(2)
    extra = {"prefill_url": f"127.0.0.1:{port}"}
    env = {BOOTSTRAP_PORT_ENV: str(boot)} if set_by == "env" else {}
    if set_by == "setting":
        extra["bootstrap_port"] = boot
    cfg = resolve(load_settings(extra, env={}), "kv_producer", "prefill", 1, env=env)
    if set_by is None:  # upstream's default, 8998, stands in for this free port
        assert not cfg.bootstrap_port_set
        cfg = dataclasses.replace(cfg, bootstrap_port=boot)
    try:
        if set_by is not None:
            assert cfg.bootstrap_port_set
            with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{boot}"):
                SchedulerHalf(cfg, BLOCK, HASH)
            return
        with caplog.at_level(logging.WARNING):
            half = SchedulerHalf(cfg, BLOCK, HASH)
        try:
            said = [r.getMessage() for r in caplog.records if "serves no bootstrap" in r.message]
            assert len(said) == 1 and f"127.0.0.1:{boot}" in said[0], said
            half.set_layouts({0: RankLayout("127.0.0.1:1", [protocol.MemSegment(0, 100, 100)], 0)})
            req = request("p1", 300, {"do_remote_decode": True, "transfer_id": XFER},
                          status=RequestStatus.FINISHED_STOPPED, computed=300)  # fmt: skip
            held, params = half.request_finished(req, [5, 6, 7])
            assert held and protocol.parse_handoff(params).remote_block_ids == [5, 6, 7]
            assert "remote_bootstrap_addr" not in params
        finally:
            half.shutdown()
    finally:
        other.close()


def producer_cfg_on(port: int, boot: int, engine_id: str):
    settings = load_settings({"prefill_url": f"127.0.0.1:{port}", "bootstrap_port": boot}, env={})
    return resolve(settings, "kv_producer", engine_id, 1)


def test_a_decode_leg_of_upstreams_convention_becomes_a_pending_load(consumer):
    params = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": XFER,
              "remote_bootstrap_addr": "http://127.0.0.2:8998",
              "remote_engine_id": "e-1"}  # fmt: skip
    req = request("d1", 300, params)
    count, is_async, (load,) = plan(consumer, req, Blocks([10, 11, 12]))
    assert (count, is_async, load.error) == (300, True, None)
    h = load.handoff
    assert isinstance(h, protocol.PendingHandoff) and h.unresolved
    assert (h.transfer_id, h.producer_engine_id, h.bootstrap_addr) == (
        XFER,
        "e-1",
        "http://127.0.0.2:8998",
    )
    assert load.local_block_ids == [10, 11, 12] and load.checks.prompt_len == 300


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"transfer_id": "xfer- 1"}, "transfer_id 'xfer- 1' is not one a producer takes"),
        ({"transfer_id": 7}, "transfer_id 7 is not one a producer takes"),
        ({"transfer_id": None}, "transfer_id None is not one"),
        ({"remote_engine_id": ""}, "remote_engine_id '' must name"),
        ({"remote_bootstrap_addr": "127.0.0.2:8998"}, "must be 'http://host:port'"),
        ({"remote_bootstrap_addr": None}, "must be 'http://host:port'"),
    ],
)
def test_a_decode_leg_of_upstreams_convention_it_cannot_use_is_not_claimed(change, error, caplog):
    """As vLLM's upstream connector: no usable transfer id, engine id or bootstrap address,
    nothing is pulled and the decode computes the prompt (under any policy), saying why."""
    settings = load_settings({"decode_url": "127.0.0.1:17000"}, env={})
    half = SchedulerHalf(resolve(settings, "kv_consumer", "decode", 1), BLOCK, HASH)
    params = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": XFER,
              "remote_bootstrap_addr": "http://127.0.0.2:8998", "remote_engine_id": "e-1",
              **change}  # fmt: skip
    try:
        req = request("d1", 300, params)
        assert half.get_num_new_matched_tokens(req, 0) == (0, False)
        half.update_state_after_alloc(req, Blocks([10, 11, 12]), 0)
        assert half.build_connector_meta(STEP).loads == []
        assert "not pulled, the prompt is computed here" in caplog.text and error in caplog.text
    finally:
        half.shutdown()


def test_an_upstream_decode_leg_naming_an_untrusted_bootstrap_is_claimed_and_failed():
    """A usable address outside ``trusted_producers`` is refused, not computed around: the
    policy decides, and nothing is sent there."""
    settings = load_settings(
        {"decode_url": "127.0.0.1:17000", "trusted_producers": ["127.0.0.0/24"]}, env={}
    )
    half = SchedulerHalf(resolve(settings, "kv_consumer", "decode", 1), BLOCK, HASH)
    params = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": XFER,
              "remote_bootstrap_addr": "http://10.9.9.9:8998",
              "remote_engine_id": "e-1"}  # fmt: skip
    try:
        _, _, (load,) = plan(half, request("d1", 300, params), Blocks([10, 11, 12]))
        assert load.handoff is None and "not in trusted_producers" in load.error
    finally:
        half.shutdown()


@pytest.mark.parametrize(
    ("status", "computed", "params"),
    [
        (RequestStatus.FINISHED_ABORTED, 300, {"do_remote_decode": True}),  # client went away
        (RequestStatus.FINISHED_STOPPED, 200, {"do_remote_decode": True}),  # prompt incomplete
        (RequestStatus.FINISHED_STOPPED, 300, None),  # an ordinary request
    ],
)
def test_nothing_is_held_for_an_aborted_incomplete_or_ordinary_request(
    producer, status, computed, params
):
    req = request("p1", 300, params, status=status, computed=computed)
    assert producer.request_finished(req, [5, 6, 7]) == (False, None)
    assert producer.get_stats().data["held_leases"] == 0


def test_frames_the_side_channel_dropped_are_counted_in_the_producers_stats(producer):
    port = producer._cfg.side_channel_port(0)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        for junk in (b"", b"not a frame", b"\xc1"):
            peer.send(junk)
        rejected, deadline = 0, time.monotonic() + 15
        while rejected < 3:  # reported by the lease server at most every few seconds
            assert time.monotonic() < deadline, rejected
            rejected += producer.get_stats().data["rejected_frames"]
            time.sleep(0.05)
        assert rejected == 3
    finally:
        peer.close()


def test_with_its_lease_server_gone_a_producer_holds_nothing_and_says_why_once(producer, caplog):
    producer._leases._proc.kill()  # e.g. killed by the kernel's OOM killer
    producer._leases._proc.wait()
    params = {"do_remote_decode": True}
    for i in range(2):
        req = request(f"p{i}", 300, params, status=RequestStatus.FINISHED_STOPPED, computed=300)
        assert producer.request_finished(req, [5, 6, 7]) == (False, None)
    assert caplog.text.count("lease server") == 1
    assert producer.get_stats().data["held_leases"] == 0


# ---- TP: an MLA latent is replicated, so any consumer TP size reads one shared lease ----------


def free_port_run(count: int) -> int:
    """A port with the ``count - 1`` ports after it free too (a TP2 producer binds port + 1 and
    port + 3: another test's side channel there would answer in its place)."""
    while True:
        port = free_port("127.0.0.1")
        try:
            for p in range(port, port + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def tp2_producer(kv_replicated: bool) -> SchedulerHalf:
    port = free_port_run(4)
    settings = load_settings({"prefill_url": f"127.0.0.1:{port}", "bootstrap_port": 0}, env={})
    cfg = resolve(settings, "kv_producer", "prefill", 2)
    half = SchedulerHalf(cfg, BLOCK, HASH, kv_replicated=kv_replicated)
    half.set_layouts(
        {
            r: RankLayout(f"127.0.0.1:{r + 1}", [protocol.MemSegment(r, 1000, 1000)], 0)
            for r in range(2)
        }
    )
    return half


@pytest.mark.parametrize("consumer_tp", [1, 2, 3])
def test_an_mla_prefill_at_tp2_is_freed_once_every_consumer_rank_pulled_it_once(consumer_tp):
    producer, client = tp2_producer(kv_replicated=True), SideChannelClient()
    try:
        req = request("p1", 300, {"do_remote_decode": True},
                      status=RequestStatus.FINISHED_STOPPED, computed=300)  # fmt: skip
        h = protocol.parse_handoff(producer.request_finished(req, [5, 6, 7])[1])
        assert (h.producer_tp_size, len(h.side_channel_ports)) == (2, 2)
        # One lease (held on both ranks), not one per rank pair.
        stats = producer.get_stats().data
        assert (stats["held_leases"], stats["held_bytes"]) == (1, 2 * 3 * 1000)
        sources = [producer_rank_for(r, consumer_tp, 2, True) for r in range(consumer_tp)]
        addresses = [f"127.0.0.1:{h.side_channel_ports[src]}" for src in sources]
        owners = [bytes([r + 1]) * protocol.OWNER_BYTES for r in range(consumer_tp)]  # one per rank
        inc, readers = h.producer_incarnation, MAX_READERS + 1
        too_many = protocol.Acquire(
            h.transfer_id, [5, 6, 7], b"z" * protocol.OWNER_BYTES, readers, inc
        )
        reply = client.call(addresses[0], too_many, timeout_s=5)
        assert reply == protocol.Refused(
            h.transfer_id, f"readers={readers} outside 1..{readers - 1}"
        )
        for src, address, owner in zip(sources, addresses, owners, strict=True):
            acquire = protocol.Acquire(h.transfer_id, [5, 6, 7], owner, consumer_tp, inc)
            reply = client.call(address, acquire, timeout_s=5)
            assert isinstance(reply, protocol.Granted)
            assert reply.te_segment == f"127.0.0.1:{src + 1}"  # that rank's own memory
        for i, (address, owner) in enumerate(zip(addresses, owners, strict=True)):
            assert producer.build_connector_meta(STEP).finished_sending == set()
            client.call(address, protocol.Release(h.transfer_id, True, owner), timeout_s=5)
            assert (i == consumer_tp - 1) == (producer.get_stats().data["held_leases"] == 0)
        assert producer.build_connector_meta(STEP).finished_sending == {"p1"}
    finally:
        client.close()
        producer.shutdown()


def test_a_per_head_kv_prefill_at_tp2_waits_for_both_rank_pairs():
    producer, client = tp2_producer(kv_replicated=False), SideChannelClient()
    try:
        req = request("p1", 300, {"do_remote_decode": True},
                      status=RequestStatus.FINISHED_STOPPED, computed=300)  # fmt: skip
        h = protocol.parse_handoff(producer.request_finished(req, [5, 6, 7])[1])
        first, second = (f"127.0.0.1:{port}" for port in h.side_channel_ports)
        tid, inc = h.transfer_id, h.producer_incarnation
        a, b = b"a" * protocol.OWNER_BYTES, b"b" * protocol.OWNER_BYTES
        assert isinstance(
            client.call(first, protocol.Acquire(tid, [5, 6, 7], a, 1, inc), 5), protocol.Granted
        )
        client.call(first, protocol.Release(tid, True, a), timeout_s=5)
        assert producer.build_connector_meta(STEP).finished_sending == set()  # rank 1's shard
        # Readers are bounded (a consumer of a larger TP reads a rank with several ranks).
        refused = client.call(second, protocol.Acquire(tid, [5, 6, 7], b, MAX_READERS + 1, inc), 5)
        assert refused == protocol.Refused(
            tid, f"readers={MAX_READERS + 1} outside 1..{MAX_READERS}"
        )
        assert isinstance(
            client.call(second, protocol.Acquire(tid, [5, 6, 7], b, 1, inc), 5), protocol.Granted
        )
        client.call(second, protocol.Release(tid, True, b), timeout_s=5)
        assert producer.build_connector_meta(STEP).finished_sending == {"p1"}
    finally:
        client.close()
        producer.shutdown()


# ---- compat hash: an MLA engine and a per-head K/V engine never validate against each other ----


def engine_config(
    mla_latent: tuple[int, int] | None = None, tp_size: int = 1, **model
) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` that ``engine_compat_hash`` reads, as vLLM reports them for a
    Llama (4 KV heads of 64) or, with ``mla_latent=(kv_lora_rank, qk_rope_head_dim)``, for a
    DeepSeek-V2 model served with MLA (one "KV head" as wide as the latent)."""
    if mla_latent:
        hf = SimpleNamespace(
            architectures=["DeepseekV2ForCausalLM"],
            kv_lora_rank=mla_latent[0],
            qk_rope_head_dim=mla_latent[1],
        )
        kv_heads, head_size = 1, sum(mla_latent)
    else:
        hf = SimpleNamespace(architectures=["LlamaForCausalLM"])
        kv_heads, head_size = 4, 64
    fields = {"hf": hf, "kv_heads": kv_heads, "head_size": head_size, **model}
    model_config = SimpleNamespace(
        hf_config=fields["hf"],
        hf_text_config=fields["hf"],
        use_mla=mla_latent is not None,
        dtype="torch.float32",
        get_total_num_hidden_layers=lambda: 2,
        get_num_kv_heads=lambda pc: fields["kv_heads"],
        get_total_num_kv_heads=lambda: fields["kv_heads"],
        get_head_size=lambda: fields["head_size"],
    )
    return SimpleNamespace(
        model_config=model_config,
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
    )


def test_an_engines_compat_hash_covers_its_kv_layout_and_model():
    """What ``engine_compat_hash`` digests, spelled out field by field (``compat_hash`` itself is
    pinned in test_protocol): a Llama's per-head K/V at its TP size (the pool's keys) or at any
    (P2P), a DeepSeek-V2's MLA latent at any TP size, and the model when known."""
    from vllm.platforms import current_platform

    llama = {
        "architectures": ["LlamaForCausalLM"],
        "layers": 2,
        "kv_heads": 4,
        "head_size": 64,
        "use_mla": False,
        "mla_latent": None,
        "dtype": "torch.float32",
        "kv_dtype": "auto",
        "block_size": 16,
        "tp_size": 2,
        "device": current_platform.device_type,
        "model": None,
    }
    assert engine_compat_hash(engine_config(tp_size=2)) == compat_hash(**llama)
    assert engine_compat_hash(engine_config(tp_size=2), "team/ft-1") == compat_hash(
        **{**llama, "model": "team/ft-1"}
    )
    mla = {
        **llama,
        "architectures": ["DeepseekV2ForCausalLM"],
        "kv_heads": 1,
        "head_size": 576,
        "use_mla": True,
        "mla_latent": [512, 64],
        "tp_size": None,
    }
    assert engine_compat_hash(engine_config(mla_latent=(512, 64), tp_size=2)) == compat_hash(**mla)
    # P2P re-lays KV out: TP size and block size are left out, KV heads counted over all ranks.
    any_layout = {**llama, "block_size": None, "tp_size": None}
    for tp in (1, 2, 4):
        assert engine_compat_hash(engine_config(tp_size=tp), any_layout=True) == compat_hash(
            **any_layout
        )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(engine_config(), engine_config(mla_latent=(512, 64)), id="llama-vs-mla"),
        # Even with the model, head count and head size made alike, MLA on or off alone differs.
        pytest.param(
            engine_config(mla_latent=(512, 64)),
            engine_config(
                hf=SimpleNamespace(architectures=["DeepseekV2ForCausalLM"]),
                kv_heads=1,
                head_size=576,
            ),
            id="mla-flag-alone",
        ),
        pytest.param(
            engine_config(mla_latent=(512, 64)), engine_config(mla_latent=(256, 64)), id="width"
        ),
        pytest.param(
            engine_config(mla_latent=(512, 64)), engine_config(mla_latent=(544, 32)), id="split"
        ),
    ],
)
def test_compat_hash_tells_kv_layouts_apart(a, b):
    assert engine_compat_hash(a) != engine_compat_hash(b)


def test_a_handoff_from_an_mla_producer_is_refused_by_a_llama_consumer_naming_mla():
    settings = load_settings({"decode_url": "127.0.0.1:17000"}, env={})
    cfg = resolve(settings, "kv_consumer", "decode", 1)
    half = SchedulerHalf(cfg, BLOCK, engine_compat_hash(engine_config()))
    try:
        mla_hash = engine_compat_hash(engine_config(mla_latent=(512, 64)))
        params = handoff_params(300, compat_hash=mla_hash)
        _, is_async, (load,) = plan(half, request("r1", 300, params), Blocks([10, 11, 12]))
    finally:
        half.shutdown()
    assert is_async  # claimed, then reported failed: vLLM's kv_load_failure_policy decides
    assert "compat hash mismatch" in load.error and "MLA latent" in load.error


def test_mla_engines_of_any_tp_sizes_share_a_compat_hash_per_head_kv_engines_do_not():
    mla = [engine_compat_hash(engine_config(mla_latent=(512, 64), tp_size=n)) for n in (1, 2, 4)]
    assert len(set(mla)) == 1
    llama = [engine_compat_hash(engine_config(tp_size=n)) for n in (1, 2)]
    assert llama[0] != llama[1]


def test_the_refusal_names_both_kv_layouts():
    settings = load_settings({"decode_url": "127.0.0.1:17000"}, env={})
    llama = engine_config()
    half = SchedulerHalf(
        resolve(settings, "kv_consumer", "decode", 1),
        BLOCK,
        engine_compat_hash(llama),
        kv_layout=engine_kv_layout(llama),
    )
    mla = engine_config(mla_latent=(512, 64))
    try:
        params = handoff_params(
            300, compat_hash=engine_compat_hash(mla), kv_layout=engine_kv_layout(mla)
        )
        _, _, (load,) = plan(half, request("r1", 300, params), Blocks([10, 11, 12]))
    finally:
        half.shutdown()
    assert "producer: MLA latent 512+64, 2 layers" in load.error
    assert "this consumer: per-head K/V 4 heads x 64 (TP 1), 2 layers" in load.error


@pytest.mark.parametrize(
    ("producer_model", "consumer_model", "named"),
    [
        ("a" * 64, "b" * 64, ("model aaaaaaaaaaaa", "model bbbbbbbbbbbb")),  # two fingerprints
        ("team/ft-1", "team/ft-2", ("model team/ft-1", "model team/ft-2")),  # declared names
    ],
)
def test_the_same_layout_with_another_model_is_refused_naming_both_models(
    producer_model, consumer_model, named
):
    """A fine-tune of the same shape: equal KV layouts, different model identities."""
    settings = load_settings({"decode_url": "127.0.0.1:17000"}, env={})
    llama = engine_config()
    assert engine_compat_hash(llama, producer_model) != engine_compat_hash(llama, consumer_model)
    half = SchedulerHalf(
        resolve(settings, "kv_consumer", "decode", 1),
        BLOCK,
        engine_compat_hash(llama, consumer_model),
        kv_layout=engine_kv_layout(llama, consumer_model),
    )
    try:
        params = handoff_params(
            300,
            compat_hash=engine_compat_hash(llama, producer_model),
            kv_layout=engine_kv_layout(llama, producer_model),
        )
        _, _, (load,) = plan(half, request("r1", 300, params), Blocks([10, 11, 12]))
    finally:
        half.shutdown()
    assert "compat hash mismatch" in load.error
    producer_words, consumer_words = load.error.split("; producer: ")[1].split(", this consumer: ")
    assert producer_words.endswith(named[0]) and consumer_words.endswith(named[1])


# ---- pending handoffs (the proxy's --dispatch concurrent) --------------------------------------


def _finish_prefill(producer, req_id: str, transfer_id: str) -> protocol.Handoff:
    req = request(req_id, 300, {"do_remote_decode": True, "transfer_id": transfer_id},
                  status=RequestStatus.FINISHED_STOPPED, computed=300)  # fmt: skip
    return protocol.parse_handoff(producer.request_finished(req, [5, 6, 7])[1])


def test_a_pending_acquire_waits_for_the_prefill_and_is_granted_its_handoff(producer):
    client, tid, owner = SideChannelClient(), "ab" * 16, b"o" * protocol.OWNER_BYTES
    address = f"127.0.0.1:{producer._cfg.side_channel_port(0)}"
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.call, address, pending_acquire(tid, owner, 5000), 5)
            time.sleep(0.3)
            assert not waiting.done()  # parked at the lease server: the prefill is not done
            h = _finish_prefill(producer, "p1", tid)
            reply = waiting.result(timeout=5)
        assert isinstance(reply, protocol.Granted) and reply.handoff == h
        assert h.transfer_id == tid and h.remote_block_ids == [5, 6, 7]
        client.call(address, protocol.Release(tid, True, owner), timeout_s=5)
        assert producer.build_connector_meta(STEP).finished_sending == {"p1"}
    finally:
        client.close()


def test_a_pending_acquire_is_refused_at_its_deadline_or_withdrawn_by_its_owner(producer):
    client, owner = SideChannelClient(), b"o" * protocol.OWNER_BYTES
    address = f"127.0.0.1:{producer._cfg.side_channel_port(0)}"
    try:
        tid = "cd" * 16
        t0 = time.monotonic()
        reply = client.call(address, pending_acquire(tid, owner, 300), 5)
        assert isinstance(reply, protocol.Refused) and "within 0.3s" in reply.reason
        assert 0.25 < time.monotonic() - t0 < 3
        # Withdrawn: a release by the acquire's owner takes it off the waiting list, so the
        # prefill finishing later grants nobody and the lease is held for a real consumer.
        tid = "ef" * 16
        cancelled = threading.Event()
        cancelled.set()
        with pytest.raises(CallCancelled):
            client.call(address, pending_acquire(tid, owner, 5000), 5, cancelled)
        released = client.call(address, protocol.Release(tid, False, owner), timeout_s=5)
        assert released == protocol.Released(tid)
        _finish_prefill(producer, "p2", tid)
        other = b"x" * protocol.OWNER_BYTES
        granted = client.call(address, pending_acquire(tid, other, 1000), 5)
        assert isinstance(granted, protocol.Granted)  # nobody else had taken it
    finally:
        client.close()


def test_a_consumer_takes_a_pending_handoff_and_cancels_its_pull_when_aborted(consumer):
    pending = {
        "do_remote_prefill": True, "pending": True, "transfer_id": "12" * 16,
        "producer_engine_id": "prefill-x", "side_channel_host": "127.0.0.2",
        "side_channel_ports": [14001], "producer_tp_size": 1,
    }  # fmt: skip
    req = request("d1", 300, dict(pending))
    assert consumer.get_num_new_matched_tokens(req, 0) == (300, True)
    consumer.update_state_after_alloc(req, Blocks([7, 8, 9]), 300)
    (load,) = consumer.build_connector_meta(STEP).loads
    assert isinstance(load.handoff, protocol.PendingHandoff) and load.error is None
    assert (load.remote_block_ids, load.local_block_ids) == ([], [7, 8, 9])
    assert load.checks.prompt_len == 300 and load.checks.compat_hash == HASH
    req.status = RequestStatus.FINISHED_ABORTED
    assert consumer.request_finished(req, [7, 8, 9]) == (False, None)
    assert consumer.build_connector_meta(STEP).cancelled == {"d1"}
    assert consumer.build_connector_meta(STEP).cancelled == set()  # said once


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"transfer_id": "t 1"}, "transfer_id must be 1-128 letters, digits and ._:-"),
        ({"side_channel_ports": [1, 2]}, "2 side_channel_ports for producer_tp_size 1"),
        ({"side_channel_host": ""}, "names the producer's side channel"),
        ({"producer_tp_size": 0, "side_channel_ports": []}, "names the producer's side channel"),
        ({"version": 9}, "handoff version 9"),
    ],
)
def test_a_malformed_pending_handoff_is_rejected_through_the_policy(consumer, change, error):
    pending = {
        "do_remote_prefill": True, "pending": True, "transfer_id": "12" * 16,
        "producer_engine_id": "prefill-x", "side_channel_host": "127.0.0.2",
        "side_channel_ports": [14001], "producer_tp_size": 1, **change,
    }  # fmt: skip
    req = request("d1", 300, pending)
    consumer.get_num_new_matched_tokens(req, 0)
    consumer.update_state_after_alloc(req, Blocks([7, 8, 9]), 300)
    (load,) = consumer.build_connector_meta(STEP).loads
    assert load.handoff is None and error in load.error


# ---- layer by layer (layerwise_handoff) --------------------------------------------------------


@pytest.fixture
def layerwise_producer():
    port = free_port_run(2)
    settings = load_settings(
        {"prefill_url": f"127.0.0.1:{port}", "layerwise_handoff": True, "bootstrap_port": 0},
        env={},
    )
    half = SchedulerHalf(resolve(settings, "kv_producer", "prefill", 1), BLOCK, HASH)
    layers = [protocol.MemSegment(1000 * i, 1000, 1000) for i in range(3)]
    half.set_layouts({0: RankLayout("127.0.0.1:1", layers, worker_pid=0)})
    push = zmq.Context.instance().socket(zmq.PUSH)  # what the producer's workers send on
    push.setsockopt(zmq.LINGER, 0)
    push.connect(layers_endpoint(half._cfg.host, half._cfg.base_port))
    client = SideChannelClient()
    yield half, push, client, f"127.0.0.1:{half._cfg.side_channel_port(0)}"
    client.close()
    push.close()
    half.shutdown()


def _last_step(
    half,
    req_id: str,
    tid: str,
    prompt_len: int = 300,
    scheduled: int = 300,
    max_tokens: int = 1,
    others: int = 0,
):
    """vLLM's calls for a prefill leg scheduled now (its whole prompt unless ``scheduled`` says
    less; ``others``: another request's tokens in the same step): the step's metadata."""
    req = request(req_id, prompt_len, {"do_remote_decode": True, "transfer_id": tid})
    req.sampling_params = SimpleNamespace(max_tokens=max_tokens)
    half.update_state_after_alloc(req, Blocks([5, 6, 7]), 0)
    new = SimpleNamespace(req_id=req_id, block_ids=([5, 6, 7],), num_computed_tokens=0)
    tokens = {req_id: scheduled} | ({"other": others} if others else {})
    step = SimpleNamespace(
        total_num_scheduled_tokens=sum(tokens.values()), finished_req_ids=set(),
        scheduled_new_reqs=[new], num_scheduled_tokens=tokens,
    )  # fmt: skip
    return req, half.build_connector_meta(step)


def _mark(push, meta, layer: int, token: bytes | None = None) -> None:
    done = LayerDone(meta.layers_token if token is None else token, 0, layer, meta.layer_marks)
    push.send(encode(done))


def test_layers_are_granted_as_the_workers_write_them_and_all_once_the_prefill_finished(
    layerwise_producer,
):
    half, push, client, address = layerwise_producer
    tid, owner = "ab" * 16, b"o" * protocol.OWNER_BYTES
    pending = pending_acquire(tid, owner, 5000, layers_ok=True)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.call, address, pending, 5)
        time.sleep(0.2)
        assert not waiting.done()  # the prefill is not scheduled yet
        req, meta = _last_step(half, "p1", tid)
        assert meta.layer_marks == [tid] and len(meta.layers_token) == 16
        granted = waiting.result(timeout=5)
    assert isinstance(granted, protocol.Granted) and granted.ready == 0
    assert granted.handoff.remote_block_ids == [5, 6, 7] and granted.handoff.prompt_len == 300
    _mark(push, meta, 2)
    assert client.call(address, protocol.Await(tid, owner, 0, 3000), 5) == protocol.Progress(
        tid, 0b100
    )
    _mark(push, meta, 0, token=b"x" * 16)  # another local process cannot mark a layer
    t0 = time.monotonic()
    unchanged = client.call(address, protocol.Await(tid, owner, 0b100, 300), 5)
    assert unchanged == protocol.Progress(tid, 0b100) and time.monotonic() - t0 >= 0.25
    req.status, req.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 300
    held, params = half.request_finished(req, [5, 6, 7, 8])
    assert held and protocol.parse_handoff(params) == granted.handoff
    done = client.call(address, protocol.Await(tid, owner, 0b100, 3000), 5)
    assert done == protocol.Progress(tid, protocol.ALL_LAYERS)
    assert half.build_connector_meta(STEP).finished_sending == set()  # still acquired
    client.call(address, protocol.Release(tid, True, owner), timeout_s=5)
    assert half.build_connector_meta(STEP).finished_sending == {"p1"}


def test_an_aborted_prefill_refuses_its_reader_and_holds_the_blocks_until_released(
    layerwise_producer,
):
    half, _, client, address = layerwise_producer
    tid, owner = "cd" * 16, b"o" * protocol.OWNER_BYTES
    req, _ = _last_step(half, "p1", tid)
    pending = pending_acquire(tid, owner, 5000, layers_ok=True)
    assert client.call(address, pending, 5).ready == 0
    # An acquire that does not take layers as they come waits for the end.
    other = pending_acquire(tid, b"x" * protocol.OWNER_BYTES, 300)
    assert "within 0.3s" in client.call(address, other, 5).reason
    req.status = RequestStatus.FINISHED_ABORTED
    assert half.request_finished(req, [5, 6, 7]) == (True, None)  # kept: it may be read
    refused = client.call(address, protocol.Await(tid, owner, 0, 3000), 5)
    assert isinstance(refused, protocol.Refused) and "without a handover" in refused.reason
    assert half.build_connector_meta(STEP).finished_sending == set()
    client.call(address, protocol.Release(tid, False, owner), timeout_s=5)
    assert half.build_connector_meta(STEP).finished_sending == {"p1"}


@pytest.mark.parametrize(
    "step",
    [{"scheduled": 128}, {"max_tokens": 2}, {"others": 40}],
    ids=["chunk", "decodes", "shared"],
)
def test_a_prompt_not_whole_and_alone_in_its_last_step_is_held_at_the_end(layerwise_producer, step):
    """Not the request's last step, or not its whole prompt: its blocks are held at the end. So
    are those of a prompt that shares its step: reads beside a step's compute slow it when other
    prompts share it, so only a prompt alone in its step opens its lease early."""
    half, _, client, address = layerwise_producer
    tid = "ef" * 16
    req, meta = _last_step(half, "p1", tid, **step)
    assert meta.layer_marks == []
    req.status, req.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 300
    held, params = half.request_finished(req, [5, 6, 7])
    handoff = protocol.parse_handoff(params)
    assert held and handoff.transfer_id == tid and handoff.remote_block_ids == [5, 6, 7]
    acquire = pending_acquire(tid, b"o" * protocol.OWNER_BYTES, 1000, layers_ok=True)
    assert client.call(address, acquire, 5).ready == protocol.ALL_LAYERS
