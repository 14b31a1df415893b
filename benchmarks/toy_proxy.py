"""The reference a proxy is compared with: a minimal FastAPI + httpx prefill/decode proxy.

    python -m benchmarks.toy_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

The toy kind found in examples: prefill with ``max_tokens=1`` and ``do_remote_decode``, then send
the request with the returned ``kv_transfer_params`` to decode and relay its answer (streamed when
asked). No health checks, no retries, no deadlines beyond httpx's defaults, one backend each.
"""

from __future__ import annotations

import argparse
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def make_app(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=None)  # default pool limits, as in the toy proxies

    async def handle(request: Request, path: str):
        body = await request.json()
        first = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": str(uuid.uuid4())},
        }
        head = (await client.post(prefill + path, json=first)).json()
        second = {**body, "kv_transfer_params": head.get("kv_transfer_params")}
        if not body.get("stream"):
            resp = await client.post(decode + path, json=second)
            return JSONResponse(resp.json(), status_code=resp.status_code)

        async def relay():
            async with client.stream("POST", decode + path, json=second) as resp:
                async for chunk in resp.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "/v1/chat/completions")

    @app.get("/health")
    async def health():
        return {}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(
        make_app(args.prefill, args.decode),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
