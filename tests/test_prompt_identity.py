"""A prompt's identity beside its tokens: read from a request shaped like vLLM's, cut per block
as vLLM's prefix cache cuts it, and whole for the P2P lease binding (stubs, no vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mooncake_vllm.core.prompt_identity import (
    PLAIN,
    MMSpan,
    PromptIdentity,
    block_extra_keys,
    identity_bytes,
    prompt_identity,
    request_identity,
)


def lora(name="sql", path="/adapters/sql", int_id=1):
    return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=int_id)


def image(identifier, offset, length):
    return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset,
                           length=length))  # fmt: skip


def request(**fields):
    base = {"lora_request": None, "mm_features": [], "cache_salt": None, "prompt_embeds": None}
    return SimpleNamespace(**{**base, **fields})


def test_a_plain_request_has_the_plain_identity_and_adds_nothing():
    assert prompt_identity(request()) == PLAIN and PLAIN.is_plain
    assert prompt_identity(SimpleNamespace()) == PLAIN  # fields vLLM may not set
    assert block_extra_keys(PLAIN, 0, 16) == b"" and request_identity(request()) == b""


def test_the_identity_reads_lora_images_and_salt():
    got = prompt_identity(
        request(
            lora_request=lora(),
            mm_features=[image("img-b", 40, 8), image("img-a", 4, 8)],
            cache_salt="tenant-1",
        )
    )
    assert got == PromptIdentity(
        lora=("sql", "/adapters/sql"),
        mm=(MMSpan("img-a", 4, 8), MMSpan("img-b", 40, 8)),  # sorted by offset
        cache_salt="tenant-1",
    )
    assert not got.is_plain


def test_prompt_embeddings_have_no_identity_made_of_token_ids():
    assert prompt_identity(request(prompt_embeds=object())) is None
    assert request_identity(request(prompt_embeds=object())) == b""


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        # The adapter is named by name and path, never by the engine-local int id.
        (lora(int_id=1), lora(int_id=7), True),
        (lora(name="sql"), lora(name="chat"), False),
        (lora(path="/adapters/v1"), lora(path="/adapters/v2"), False),
        (None, lora(), False),
    ],
)
def test_the_adapter_is_its_name_and_path(a, b, same):
    ia, ib = prompt_identity(request(lora_request=a)), prompt_identity(request(lora_request=b))
    assert (ia == ib) is same
    assert (request_identity(request(lora_request=a)) == request_identity(
        request(lora_request=b))) is same  # fmt: skip


IMAGE = PromptIdentity(mm=(MMSpan("img", 20, 24),))  # tokens 20..43


@pytest.mark.parametrize(
    ("start", "end", "keys"),
    [
        (0, 16, b""),  # before the image
        (16, 32, b'[["mm","img",4]]'),  # the image starts 4 tokens in
        (32, 48, b'[["mm","img",-12]]'),  # it began 12 tokens before this block
        (44, 60, b""),  # after it
        (40, 44, b'[["mm","img",-20]]'),  # a partial tail still inside it
    ],
)
def test_an_image_is_keyed_on_the_blocks_it_overlaps_with_its_offset(start, end, keys):
    assert block_extra_keys(IMAGE, start, end) == keys


def test_the_salt_is_on_the_first_block_and_the_adapter_on_every_block():
    ident = PromptIdentity(lora=("sql", "/a"), cache_salt="t1")
    assert block_extra_keys(ident, 0, 16) == b'[["lora","sql","/a"],["cache_salt","t1"]]'
    assert block_extra_keys(ident, 16, 32) == b'[["lora","sql","/a"]]'


def test_the_whole_identity_is_canonical_and_tells_every_field_apart():
    variants = [
        PLAIN,
        PromptIdentity(cache_salt="t1"),
        PromptIdentity(cache_salt="t2"),
        PromptIdentity(lora=("sql", "")),
        PromptIdentity(lora=("sql", "/a")),
        PromptIdentity(mm=(MMSpan("img", 0, 4),)),
        PromptIdentity(mm=(MMSpan("img", 0, 5),)),
        PromptIdentity(mm=(MMSpan("img", 1, 4),)),
        PromptIdentity(mm=(MMSpan("other", 0, 4),)),
        # A salt that spells another field's encoding stays a salt.
        PromptIdentity(cache_salt='"],["lora","sql","/a'),
    ]
    encoded = [identity_bytes(v) for v in variants]
    assert len(set(encoded)) == len(variants)
    assert identity_bytes(PromptIdentity(cache_salt="t1")) == identity_bytes(
        PromptIdentity(cache_salt="t1")
    )
