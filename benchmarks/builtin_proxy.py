"""A prefill/decode proxy speaking the protocol of vLLM's built-in MooncakeConnector.

    python -m benchmarks.builtin_proxy --prefill http://127.0.0.2:8100 \
        --decode http://127.0.0.3:8200 --bootstrap http://127.0.0.2:8998 --port 8000

What vLLM's docs pair with that connector (``mooncake_connector_proxy.py`` in vLLM's examples,
which the wheel does not ship) does per request, written here on aiohttp: one transfer id; prefill
with ``max_tokens=1`` and ``{"do_remote_decode": true, "transfer_id": ...}``; then decode with
``{"do_remote_prefill": true, "remote_engine_id": ..., "remote_bootstrap_addr": ...,
"transfer_id": ...}``, its answer relayed (streamed when asked). The prefill's engine id comes
from the bootstrap server's ``/query`` once at startup. aiohttp on both sides, like our proxy, so
the connector comparison is not a comparison of HTTP stacks.
"""

from __future__ import annotations

import argparse
import uuid

import aiohttp
from aiohttp import web


def make_app(prefill: str, decode: str, bootstrap: str) -> web.Application:
    app = web.Application()
    state: dict = {}

    async def startup(app: web.Application) -> None:
        state["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
        )
        async with state["session"].get(bootstrap + "/query") as resp:
            entries = await resp.json()
        state["engine_id"] = (
            entries["0"]["engine_id"] if "0" in entries else entries[0]["engine_id"]
        )

    async def cleanup(app: web.Application) -> None:
        await state["session"].close()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        transfer_id = f"xfer-{uuid.uuid4()}"
        session: aiohttp.ClientSession = state["session"]
        first = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id},
        }
        first.pop("stream_options", None)
        async with session.post(prefill + request.path, json=first) as resp:
            await resp.read()
            if resp.status != 200:
                return web.Response(status=resp.status, body=await resp.read())
        second = {
            **body,
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "remote_engine_id": state["engine_id"],
                "remote_bootstrap_addr": bootstrap,
                "transfer_id": transfer_id,
            },
        }
        async with session.post(decode + request.path, json=second) as resp:
            if not body.get("stream"):
                return web.Response(
                    status=resp.status, body=await resp.read(), content_type="application/json"
                )
            out = web.StreamResponse(status=resp.status)
            out.content_type = "text/event-stream"
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--bootstrap", required=True, help="http://HOST:PORT of the bootstrap server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    web.run_app(
        make_app(args.prefill, args.decode, args.bootstrap),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
