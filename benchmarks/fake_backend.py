"""A minimal OpenAI-shaped backend that answers at once: the proxy benchmark's prefill and decode.

    python -m benchmarks.fake_backend --port 8100

``POST /v1/completions`` (and chat) answers a fixed completion; a request carrying
``kv_transfer_params.do_remote_decode`` (a prefill leg) gets ``kv_transfer_params`` back, as a
producer vLLM would. ``stream: true`` answers a few SSE events. ``/health`` and ``/v1/models``
answer 200. Nothing is computed, so a proxy in front of it shows only its own cost.
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

COMPLETION_TOKENS = 4


def _answer(body: dict) -> dict:
    answer = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "model": body.get("model", "bench"),
        "choices": [{"index": 0, "text": " ok" * COMPLETION_TOKENS, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": COMPLETION_TOKENS, "total_tokens": 12},
    }
    params = body.get("kv_transfer_params") or {}
    if params.get("do_remote_decode"):
        answer["kv_transfer_params"] = {
            "transfer_id": params.get("transfer_id", "t"),
            "remote_engine_id": "bench",
            "remote_block_ids": [0, 1, 2],
        }
    return answer


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.json_response(_answer(body))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(COMPLETION_TOKENS):
        event = {"choices": [{"index": 0, "text": " ok", "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(_: web.Request) -> web.Response:
    return web.Response(text="")


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    web.run_app(make_app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
