"""Wire formats: the handoff (kv_transfer_params) parsed and validated once, the compat hash,
and the side-channel frames."""

from __future__ import annotations

import json

import msgspec
import pytest

from mooncake_vllm.core.identity import compat_hash
from mooncake_vllm.p2p import protocol

# ---- protocol: the handoff ------------------------------------------------------------------

HASH = compat_hash(model="tiny", dtype="float32", block_size=16, tp_size=2)


def _handoff(**overrides) -> protocol.Handoff:
    fields = {
        "transfer_id": "t-1",
        "producer_engine_id": "prefill-0",
        "side_channel_host": "10.0.0.1",
        "side_channel_ports": [20001, 20003],
        "producer_tp_size": 2,
        "remote_block_ids": [4, 5, 9],
        "prompt_len": 40,
        "block_size": 16,
        "compat_hash": HASH,
    }
    return protocol.Handoff(**{**fields, **overrides})


def test_handoff_round_trip_through_params():
    h = _handoff()
    params = h.to_params()
    assert params["do_remote_prefill"] is True
    assert params["version"] == protocol.PROTOCOL_VERSION
    # It travels through the proxy as JSON.
    assert protocol.parse_handoff(json.loads(json.dumps(params))) == h


def test_handoff_ignores_fields_it_does_not_know():
    params = {**_handoff().to_params(), "added_in_a_later_minor": 1}
    assert protocol.parse_handoff(params) == _handoff()


@pytest.mark.parametrize(
    "field",
    [
        "transfer_id",
        "producer_engine_id",
        "producer_tp_size",
        "remote_block_ids",
        "prompt_len",
        "compat_hash",
    ],
)
def test_handoff_missing_field(field):
    params = _handoff().to_params()
    del params[field]
    with pytest.raises(protocol.HandoffError, match=field):
        protocol.parse_handoff(params)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_len", "40"),
        ("remote_block_ids", [4, "5"]),
        ("remote_block_ids", 4),
        ("side_channel_ports", "20001"),
        ("transfer_id", 7),
        ("block_size", 16.5),
        ("do_remote_prefill", "yes"),
    ],
)
def test_handoff_wrong_type(field, value):
    params = {**_handoff().to_params(), field: value}
    with pytest.raises(protocol.HandoffError, match="malformed kv_transfer_params"):
        protocol.parse_handoff(params)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"version": protocol.PROTOCOL_VERSION + 1}, "version"),
        ({"transfer_id": ""}, "empty transfer_id"),
        ({"producer_engine_id": ""}, "empty producer_engine_id"),
        ({"side_channel_ports": []}, "go together"),
        ({"side_channel_host": ""}, "go together"),
        ({"producer_tp_size": 0}, "producer_tp_size 0 must be at least 1"),
        ({"side_channel_ports": [20001]}, "1 side_channel_ports for producer_tp_size 2"),
    ],
)
def test_unusable_handoff_is_refused(overrides, match):
    with pytest.raises(protocol.HandoffError, match=match):
        protocol.parse_handoff({**_handoff().to_params(), **overrides})


def test_handoff_without_side_channel_is_looked_up_by_engine_id():
    h = protocol.parse_handoff(
        {**_handoff().to_params(), "side_channel_host": "", "side_channel_ports": []}
    )
    assert h.producer_engine_id == "prefill-0"
    _validate(h)  # no TP-rank count to compare: the registry has it


@pytest.mark.parametrize("params", [None, [], "t-1", {}])
def test_handoff_that_is_not_an_object(params):
    with pytest.raises(protocol.HandoffError):
        protocol.parse_handoff(params)


def _validate(h: protocol.Handoff, **overrides) -> None:
    request = {"prompt_len": 40, "compat_hash": HASH, "kv_heads": 4, "tp_size": 2, "block_size": 16}
    protocol.validate_handoff(h, **{**request, **overrides})


def test_matching_handoff_validates():
    _validate(_handoff())
    _validate(_handoff(prompt_len=48, remote_block_ids=[1, 2, 3]), prompt_len=48)  # full blocks
    _validate(_handoff(prompt_len=33, remote_block_ids=[1, 2, 3]), prompt_len=33)


@pytest.mark.parametrize(
    ("handoff", "request_overrides", "match"),
    [
        (_handoff(compat_hash=compat_hash(model="other")), {}, "compat hash mismatch"),
        (_handoff(), {"compat_hash": compat_hash(model="other")}, "compat hash mismatch"),
        (_handoff(), {"prompt_len": 41}, "prompt length 41 differs from the producer's 40"),
        (_handoff(prompt_len=41), {}, "prompt length 40 differs from the producer's 41"),
        (
            _handoff(remote_block_ids=[4, 5]),
            {},
            "2 remote blocks for 40 tokens of block size 16, expected 3",
        ),
        (_handoff(remote_block_ids=[4, 5, 9, 10]), {}, "4 remote blocks for 40 tokens"),
        (_handoff(block_size=32), {}, "block size 32 at the producer, 16 here, and this consumer"),
        (_handoff(block_size=0), {}, "producer block size 0 must be at least 1"),
        (
            _handoff(block_size=32, kv_format="cpu-amx"),
            {"reblock_format": "cpu-vec"},
            "KV format 'cpu-amx' at the producer, this consumer re-blocks 'cpu-vec' only",
        ),
        (
            _handoff(side_channel_ports=[20001, 20003, 20005], producer_tp_size=3),
            {},
            "4 KV heads cannot be sharded over the producer's TP size 3",
        ),
        (_handoff(), {"tp_size": 3}, "4 KV heads cannot be sharded over the consumer's TP size 3"),
    ],
)
def test_mismatching_handoff_is_refused(handoff, request_overrides, match):
    with pytest.raises(protocol.HandoffError, match=match):
        _validate(handoff, **request_overrides)


def test_a_handoff_of_another_prompt_of_the_same_length_is_refused_naming_its_id():
    mine, other = protocol.prompt_digest(range(40)), protocol.prompt_digest(range(1, 41))
    h = _handoff(transfer_id="xfer-3f2b8c1e-9d4a-4e6f-8b1c-2a3d4e5f6a7b", prompt_digest=other)
    with pytest.raises(protocol.HandoffError, match="transfer_id xfer-3f2b8c1e holds another"):
        _validate(h, prompt_digest=mine)
    _validate(h, prompt_digest=other)
    _validate(_handoff(), prompt_digest=mine)  # a producer that names no prompt: not checked


def test_the_prompt_digest_is_of_the_token_ids_and_empty_without_them():
    assert protocol.prompt_digest([1, 2, 3]) == protocol.prompt_digest((1, 2, 3))
    assert protocol.prompt_digest([1, 2, 3]) != protocol.prompt_digest([1, 2, 4])
    assert len(protocol.prompt_digest([7])) == 32
    assert protocol.prompt_digest([]) == protocol.prompt_digest(None) == ""


def test_the_prompt_digest_binds_what_else_decides_the_kv():
    """One transfer id used by two requests with the same tokens but another LoRA adapter,
    other images or another ``cache_salt`` is refused, as a prompt of other tokens is; a plain
    request's digest is its token ids' alone, as before identities existed."""
    from types import SimpleNamespace as NS

    def request(**kw):
        fields = {"prompt_token_ids": [5, 6, 7], "prompt_embeds": None, "lora_request": None}
        fields |= {"mm_features": None, "cache_salt": None, **kw}
        return NS(**fields)

    plain = protocol.request_prompt_digest(request())
    assert plain == protocol.prompt_digest([5, 6, 7])
    lora_a = NS(lora_name="a", lora_path="/adapters/a")
    lora_b = NS(lora_name="b", lora_path="/adapters/b")
    image = NS(identifier="img-1", mm_position=NS(offset=1, length=2))
    others = [
        request(lora_request=lora_a),
        request(lora_request=lora_b),
        request(cache_salt="tenant-1"),
        request(cache_salt="tenant-2"),
        request(mm_features=[image]),
    ]
    digests = [protocol.request_prompt_digest(r) for r in others]
    assert len({plain, *digests}) == 6
    assert protocol.request_prompt_digest(request(cache_salt="tenant-1")) == digests[2]
    h = _handoff(prompt_digest=digests[2])
    with pytest.raises(protocol.HandoffError, match="holds another"):
        _validate(h, prompt_digest=digests[3])


@pytest.mark.parametrize("producer_tp", [1, 2, 4, 8])
def test_any_tp_size_validates(producer_tp):
    """The consumer reads each head from a producer rank that holds it (planning.head_sources):
    TP sizes may differ, including more TP ranks than KV heads (replicated heads)."""
    ports = [20001 + 2 * r for r in range(producer_tp)]
    h = _handoff(side_channel_ports=ports, producer_tp_size=producer_tp)
    for tp in (1, 2, 4, 8):
        _validate(h, tp_size=tp)


def test_another_block_size_validates_where_both_keep_the_reblockable_format():
    h = _handoff(block_size=32, remote_block_ids=[1, 2], kv_format="cpu-vec")
    _validate(h, reblock_format="cpu-vec")
    h = _handoff(block_size=8, remote_block_ids=[1, 2, 3, 4, 5], kv_format="cpu-vec")
    _validate(h, reblock_format="cpu-vec")


def test_compat_mismatch_names_both_layouts_when_known():
    h = _handoff(compat_hash=compat_hash(model="other"), kv_layout="MLA latent 512+64")
    with pytest.raises(
        protocol.HandoffError, match="producer: MLA latent 512\\+64, this consumer: per-head"
    ):
        _validate(h, kv_layout="per-head K/V 4 heads x 64")


COMPAT_FIELDS = {
    "model": "tiny",
    "dtype": "float32",
    "kv_dtype": "auto",
    "block_size": 16,
    "tp_size": 2,
    "layout": "NHD",
}


# The digest of COMPAT_FIELDS, worked out without our code: sha256 of the fields and the compat
# version as JSON with sorted keys,
#   printf '%s' '{"block_size": 16, "dtype": "float32", "kv_dtype": "auto", "layout": "NHD",
#     "model": "tiny", "tp_size": 2, "v": 1}' | sha256sum      (one line)
# Releases that disagree on it refuse each other's handoffs and miss each other's pool keys, so
# it changes only on purpose: with the compat version, and this pin with it.
COMPAT_DIGEST = "ee5bfd68eff0b99574bf0e98ad0e6ac16040944ba92d6fc00960f68a6df77f84"


def test_compat_hash_is_the_pinned_digest_of_its_fields():
    assert compat_hash(**COMPAT_FIELDS) == COMPAT_DIGEST


def test_compat_hash_does_not_depend_on_the_order_of_its_fields():
    assert compat_hash(**dict(reversed(COMPAT_FIELDS.items()))) == COMPAT_DIGEST


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "tiny-2"),
        ("dtype", "bfloat16"),
        ("kv_dtype", "fp8"),
        ("block_size", 32),
        ("block_size", "16"),
        ("tp_size", 1),
        ("layout", "HND"),
        ("extra", None),
    ],
)
def test_compat_hash_changes_with_any_input(field, value):
    assert compat_hash(**{**COMPAT_FIELDS, field: value}) != compat_hash(**COMPAT_FIELDS)


# ---- protocol: side-channel frames ----------------------------------------------------------

OWNER = bytes(range(protocol.OWNER_BYTES))


def _packed(**fields) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    "frame",
    [
        protocol.Acquire("t-1", [4, 5, 9], OWNER),
        protocol.Acquire("t-1", [4, 5, 9], OWNER, readers=2),
        protocol.Granted(
            "t-1",
            "10.0.0.1:20000",
            [protocol.MemSegment(0x1000, 4096, 2048), protocol.MemSegment(0, 64, 64)],
        ),
        protocol.Granted("t-1", "10.0.0.1:20000", []),
        protocol.Refused("t-1", "transfer t-1 already expired"),
        protocol.Release("t-1", ok=True, owner=OWNER),
        protocol.Release("t-1", ok=False, owner=OWNER),
        protocol.Released("t-1"),
    ],
    ids=lambda f: type(f).__name__,
)
def test_frame_round_trip(frame):
    decoded = protocol.decode_frame(protocol.encode_frame(frame))
    assert type(decoded) is type(frame)
    assert decoded == frame


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"transfer_id": "t-1"}),  # no tag
        msgspec.msgpack.encode({"type": "acquire_v2", "transfer_id": "t-1"}),  # unknown kind
        _packed(type="release/3", transfer_id="t-1"),  # fields missing
        _packed(type="release/3", transfer_id="t-1", ok="yes", owner=OWNER),
        # Older peers' frames: no owner, or the tag of another version (version 2 granted
        # segments without their interior, which a re-laying consumer needs).
        _packed(type="release/1", transfer_id="t-1", ok=True),
        _packed(type="acquire/1", transfer_id="t-1", remote_block_ids=[1]),
        _packed(type="release/2", transfer_id="t-1", ok=True, owner=OWNER),
        # A version 1 frame under this version's tag (no owner), and a later version's frame.
        _packed(type="acquire/3", transfer_id="t-1", remote_block_ids=[1]),
        _packed(type="release/4", transfer_id="t-1", ok=True, owner=OWNER),
        protocol.encode_frame(protocol.Released("t-1"))[:-2],  # truncated
    ],
    ids=repr,
)
def test_malformed_frame_is_rejected(data):
    # msgspec.ValidationError is a DecodeError: one except clause covers both.
    with pytest.raises(msgspec.DecodeError):
        protocol.decode_frame(data)
