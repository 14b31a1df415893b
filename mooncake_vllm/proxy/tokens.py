"""The proxy's tokenizer: token ids for text and chat prompts, as vLLM computes them, so that
``--policy kv`` matches every prompt on the engines' KV events, not only those sent as ids.

The model's own tokenizer and chat template (``transformers.AutoTokenizer``), loaded once at
startup from ``--tokenizer`` or, without it, from the model path the engines serve (``root`` in
their ``/v1/models``). Completions: the prompt text with special tokens unless the request says
``add_special_tokens: false`` (vLLM's default); chat: the chat template over the messages with
the generation prompt (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs`` as the request gives them), its text tokenized without special tokens
again, as vLLM's renderer does. A request the tokenizer cannot render (a tool schema, an image
part) gets no ids and routes as before (``prefix.prefix_key``). Only imported with
``--policy kv``; loading runs in a thread, tokenizing too, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)


class PromptTokenizer:
    def __init__(self, tokenizer: Any, source: str):
        self._tok, self.source = tokenizer, source

    @classmethod
    def load(cls, name_or_path: str) -> PromptTokenizer:
        """Raises whatever ``transformers`` raises for a name or path it cannot load."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path), name_or_path)

    def token_ids(self, body: Mapping[str, Any], path: str) -> list[int] | None:
        """The prompt's token ids as vLLM would compute them; None when the request is not
        one this renders (never raises)."""
        try:
            if path.endswith("/chat/completions"):
                return self._chat(body)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                special = body.get("add_special_tokens", True) is not False
                return list(self._tok.encode(prompt, add_special_tokens=special))
        except Exception as e:  # a template error, an unexpected message shape: no ids
            logger.debug("no token ids for a %s request: %s", path, e)
        return None

    def _chat(self, body: Mapping[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or body.get("tools"):
            return None
        plain = [_text_message(m) for m in messages]
        if any(m is None for m in plain):
            return None
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            return None
        continue_final = body.get("continue_final_message") is True
        text = self._tok.apply_chat_template(
            plain,
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True) is not False
            and not continue_final,
            continue_final_message=continue_final,
            **kwargs,
        )
        special = body.get("add_special_tokens", False) is True
        return list(self._tok.encode(text, add_special_tokens=special))


def _text_message(message: object) -> dict[str, str] | None:
    """A chat message with string content (text parts joined by newlines, as vLLM's "string"
    content format); None for anything else (an image part, a tool call)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        return None
    content = message.get("content")
    if isinstance(content, str):
        return {"role": message["role"], "content": content}
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return {"role": message["role"], "content": "\n".join(p["text"] for p in content)}
    return None


async def served_model_root(session: aiohttp.ClientSession, urls: Sequence[str]) -> str | None:
    """The model path or name the first answering backend serves (``root`` in its
    ``/v1/models``); None if none answers."""
    for url in urls:
        try:
            async with session.get(f"{url}/v1/models") as resp:
                if resp.status != 200:
                    continue
                data = await resp.json()
            root = data["data"][0].get("root") or data["data"][0]["id"]
            if isinstance(root, str) and root:
                return root
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError,
                ValueError):  # fmt: skip
            continue
    return None


NO_TOKENIZER_YET = (
    "--policy kv: no tokenizer yet (no --tokenizer, and no backend has answered /v1/models): "
    "until one does, text and chat prompts route by their prefix, only prompts sent as token "
    "ids by the engines' KV events"
)


async def find_tokenizer(given: str | None, urls, retry_s: float = 5.0) -> PromptTokenizer | None:
    """``--tokenizer``, else the model the engines serve, asked every ``retry_s`` until one
    answers (``urls()``: the backends now); logs what it loaded, or why none."""
    warned = False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while (source := given or await served_model_root(session, urls())) is None:
            if not warned:
                logger.warning(NO_TOKENIZER_YET)
                warned = True
            await asyncio.sleep(retry_s)
    return await load_tokenizer(source)


async def load_tokenizer(source: str) -> PromptTokenizer | None:
    try:
        tok = await asyncio.to_thread(PromptTokenizer.load, source)
    except Exception as e:
        logger.warning(
            "--policy kv: tokenizer %r did not load (%s: %s); text and chat prompts route by "
            "their prefix: give --tokenizer a path or name transformers can load",
            source,
            type(e).__name__,
            e,
        )
        return None
    logger.info("--policy kv: text and chat prompts tokenized with %s", source)
    return tok
