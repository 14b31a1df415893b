"""The proxy's tokenizer (``proxy.tokens``): the token ids it computes for text and chat prompts
equal vLLM's own (``/tokenize`` of the shared cluster's plain vLLM, on the tiny model), so that
``--policy kv`` matches them on the engines' KV events; what it cannot render gets no ids."""

from __future__ import annotations

import logging

import pytest

from mooncake_vllm.proxy.tokens import PromptTokenizer, load_tokenizer

COMPLETIONS = [
    {"prompt": "the quick brown fox"},
    {"prompt": "naïve café ☕ 123 " * 20},
    {"prompt": "no special tokens", "add_special_tokens": False},
    {"prompt": " leading space and\nnew lines\n\n"},
]
CHATS = [
    {"messages": [{"role": "user", "content": "hello there"}]},
    {"messages": [{"role": "system", "content": "you are terse"},
                  {"role": "user", "content": "say three things"},
                  {"role": "assistant", "content": "one two three"},
                  {"role": "user", "content": "again"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                               {"type": "text", "text": "part two"}]}]},
    {"messages": [{"role": "user", "content": "no prompt"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "go on"},
                  {"role": "assistant", "content": "once upon"}],
     "continue_final_message": True, "add_generation_prompt": False},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(cluster) -> PromptTokenizer:
    return PromptTokenizer.load(cluster.model)


async def vllm_tokens(http, srv, body: dict) -> list[int]:
    async with http.post(f"{srv.url}/tokenize", json={"model": srv.model, **body}) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data["tokens"]


@pytest.mark.servers
@pytest.mark.parametrize("body", COMPLETIONS, ids=range(len(COMPLETIONS)))
async def test_completion_prompts_tokenize_as_vllms(pd, http, tokenizer, body):
    ours = tokenizer.token_ids(body, "/v1/completions")
    assert ours and ours == await vllm_tokens(http, pd.plain, body)


@pytest.mark.servers
@pytest.mark.parametrize("body", CHATS, ids=range(len(CHATS)))
async def test_chat_prompts_tokenize_as_vllms(pd, http, tokenizer, body):
    ours = tokenizer.token_ids(body, "/v1/chat/completions")
    assert ours and ours == await vllm_tokens(http, pd.plain, body)


class Echo:
    """A tokenizer stand-in: what the proxy asks of transformers' tokenizers."""

    def encode(self, text, add_special_tokens=True):
        return [1, *map(ord, text)] if add_special_tokens else list(map(ord, text))

    def apply_chat_template(self, messages, tokenize, **kwargs):
        assert tokenize is False
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"prompt": [1, 2, 3]}, "/v1/completions"),  # ids already: routed as they are
        ({"prompt": ["a", "b"]}, "/v1/completions"),  # a list of prompts
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "/v1/chat/completions"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "/v1/chat/completions"),
        ({"messages": [{"role": "user"}]}, "/v1/chat/completions"),
        ({"messages": "not a list"}, "/v1/chat/completions"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3},
         "/v1/chat/completions"),
    ],
)  # fmt: skip
def test_what_it_cannot_render_gets_no_ids(body, path):
    assert PromptTokenizer(Echo(), "echo").token_ids(body, path) is None


def test_a_template_that_raises_gives_no_ids_not_an_error():
    class Broken(Echo):
        def apply_chat_template(self, messages, tokenize, **kwargs):
            raise ValueError("template error")

    body = {"messages": [{"role": "user", "content": "x"}]}
    assert PromptTokenizer(Broken(), "broken").token_ids(body, "/v1/chat/completions") is None


async def test_a_tokenizer_that_does_not_load_is_named_at_startup_with_the_fix(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mooncake_vllm.proxy.tokens"):
        assert await load_tokenizer(str(tmp_path / "nothing-here")) is None
    assert "did not load" in caplog.text and "give --tokenizer" in caplog.text
