"""Test clients that drive a pair the way vLLM's upstream MooncakeConnector orchestrators do.

Written here from each one's source (read, not copied; versions in docs/compatibility.md):

- ``VllmMooncakeProxy``: vLLM's ``examples/disaggregated/mooncake_connector/
  mooncake_connector_proxy.py`` (vllm-project/vllm at 41c5903d): at start, ``GET /health`` of each
  prefill until it answers, then ``GET <bootstrap>/query`` (bootstrap: the prefill URL's host and
  its bootstrap port, 8998 by default) for ``dp_rank -> engine_id``; prefills are taken round
  robin over (prefill, DP rank). Per request: ``request_id = uuid4``, ``transfer_id =
  "xfer-" + request_id``; the prefill leg is fired as a task whose answer nobody reads
  (``stream`` false, ``max_tokens`` 1, ``max_completion_tokens`` 1 if present,
  ``stream_options`` dropped, headers ``X-Request-Id`` and ``X-data-parallel-rank``), and the
  decode leg is streamed back at once with ``remote_bootstrap_addr`` and ``remote_engine_id``.
- ``LlmdMooncake``: llm-d's routing sidecar, ``pkg/sidecar/proxy/connector_mooncake.go``
  (llm-d/llm-d-router at 0545789): bootstrap ``http://<prefill host>:<MooncakeBootstrapPort>``,
  the engine map asked once per prefill and cached (5 s timeout), the first DP rank of Go's
  random map order, ``transfer_id = "xfer-" + uuid``; both bodies built before either leaves
  (the prefill capped to one token), the prefill sent in a goroutine with the
  ``X-data-parallel-rank`` header, its answer only checked for its status, the decode's answer
  is the client's.
- ``DynamoVllm``: Dynamo's vLLM worker handlers with ``MooncakeConnector``
  (ai-dynamo/dynamo at 690ece45, ``components/src/dynamo/vllm/kv_connector_protocols.py``
  ``MooncakeConnectorProtocol`` and ``handlers.py`` ``PrefillWorkerHandler`` /
  ``DecodeWorkerHandler``): the prefill worker gives its request ``transfer_id =
  str(uuid4())`` (no ``xfer-``), ``max_tokens`` and ``min_tokens`` 1, waits for its answer, and
  only then hands the decode worker ``remote_bootstrap_addr`` from vLLM's
  ``get_mooncake_bootstrap_addr`` of the prefill's own config (``bootstrap_server_address``, else
  the DP master address) and ``remote_engine_id`` from its ``kv_transfer_config.engine_id``,
  whatever the prefill answered. Dynamo's workers call vLLM's engine in-process with token ids;
  here each leg is one HTTP request to the engine's OpenAI server, the body the client's.

And two of the NIXL-style convention (the prefill answers the params, the decode gets them), as
regression clients:

- ``LlmdNixlV2``: llm-d's sidecar with ``--kv-connector nixlv2``
  (``pkg/sidecar/proxy/connector_nixlv2.go``, llm-d/llm-d-router at 45c38549): the prefill
  with ``kv_transfer_params`` ``{do_remote_decode: true, do_remote_prefill: false}`` and nulls
  for ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, not
  streamed, ``stream_options`` dropped, the token limits (``max_tokens``, and
  ``max_completion_tokens`` for chat) set to 1, header ``X-Request-Id``; the decode with the
  client's body restored and the prefill's ``kv_transfer_params`` as they came.
- ``RayServePD``: Ray Serve LLM's default P/D backend, ``PDProxyServer``
  (``python/ray/llm/_internal/serve/serving_patterns/prefill_decode/pd_server.py``,
  ray-project/ray at c3cc5706): the same prefill params, ``max_tokens`` 1 and ``stream`` false
  on a copy of the request, the decode the request with the prefill's params; both carry the
  Serve request id as ``request_id``.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any
from urllib.parse import urlsplit

import aiohttp

BOOTSTRAP_PORT = 8998


def _bootstrap_addr(prefill_url: str, port: int | None) -> str:
    host = urlsplit(prefill_url).hostname
    host = f"[{host}]" if host and ":" in host else host
    return f"http://{host}:{port or BOOTSTRAP_PORT}"


async def _query(session: aiohttp.ClientSession, bootstrap: str) -> dict[str, str]:
    async with session.get(f"{bootstrap}/query", timeout=aiohttp.ClientTimeout(total=5)) as r:
        r.raise_for_status()
        data = await r.json()
    return {dp_rank: entry["engine_id"] for dp_rank, entry in data.items()}


class VllmMooncakeProxy:
    """vLLM's mooncake_connector_proxy.py, as a library: ``await start()``, then ``post``."""

    def __init__(self, session, prefills: list[tuple[str, int | None]], decodes: list[str]):
        self._session = session
        self._prefills = [
            {"url": url, "bootstrap_addr": _bootstrap_addr(url, port), "dp_engine_id": {}}
            for url, port in prefills
        ]
        self._decodes = decodes
        self._next_prefill = 0
        self._next_decode = 0
        self.prefill_tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for p in self._prefills:
            while True:
                try:
                    async with self._session.get(p["url"] + "/health") as r:
                        r.raise_for_status()
                except aiohttp.ClientError:
                    await asyncio.sleep(1)
                    continue
                engines = await _query(self._session, p["bootstrap_addr"])
                break
            p["dp_engine_id"] = {int(rank): eid for rank, eid in engines.items()}

    def _prefill_cycle(self) -> tuple[dict, int]:
        pairs = [(p, rank) for p in self._prefills for rank in range(len(p["dp_engine_id"]))]
        pick = pairs[self._next_prefill % len(pairs)]
        self._next_prefill += 1
        return pick

    async def _send_prefill(self, prefill: dict, dp_rank: int, api: str, body: dict, rid: str):
        body = dict(body)
        body["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": f"xfer-{rid}",
        }
        body["stream"] = False
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body.pop("stream_options", None)
        headers = {"X-Request-Id": rid, "X-data-parallel-rank": str(dp_rank)}
        async with self._session.post(prefill["url"] + api, json=body, headers=headers) as r:
            r.raise_for_status()

    async def post(self, api: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """The decode's response (the caller reads and releases it), the prefill in flight."""
        rid = str(uuid.uuid4())
        prefill, dp_rank = self._prefill_cycle()
        self.prefill_tasks.append(
            asyncio.create_task(self._send_prefill(prefill, dp_rank, api, body, rid))
        )
        decode = self._decodes[self._next_decode % len(self._decodes)]
        self._next_decode += 1
        body = dict(body)
        body["kv_transfer_params"] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": prefill["bootstrap_addr"],
            "remote_engine_id": prefill["dp_engine_id"][dp_rank],
            "transfer_id": f"xfer-{rid}",
        }
        resp = await self._session.post(decode + api, json=body, headers={"X-Request-Id": rid})
        resp.raise_for_status()
        return resp


class LlmdMooncake:
    """llm-d's sidecar with ``--kv-connector mooncake`` in front of one decode."""

    def __init__(self, session, decode_url: str, bootstrap_port: int = BOOTSTRAP_PORT):
        self._session, self._decode, self._port = session, decode_url, bootstrap_port
        self._engine_ids: dict[str, dict[str, str]] = {}  # the LRU, by prefill host:port
        self.prefill_tasks: list[asyncio.Task] = []
        self.prefill_statuses: list[int] = []

    async def post(self, prefill_url: str, api: str, body: dict) -> aiohttp.ClientResponse:
        bootstrap = _bootstrap_addr(prefill_url, self._port)
        host_port = urlsplit(prefill_url).netloc
        if host_port not in self._engine_ids:
            self._engine_ids[host_port] = await _query(self._session, bootstrap)
        dp_rank, engine_id = random.choice(list(self._engine_ids[host_port].items()))
        transfer_id = f"xfer-{uuid.uuid4()}"
        prefill_body = dict(body)
        prefill_body["kv_transfer_params"] = {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "transfer_id": transfer_id,
        }
        _cap_single_token(prefill_body, api)
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": bootstrap,
            "remote_engine_id": engine_id,
        }

        async def prefill() -> None:
            headers = {"X-data-parallel-rank": dp_rank}
            async with self._session.post(
                prefill_url + api, json=prefill_body, headers=headers
            ) as r:
                await r.read()
                self.prefill_statuses.append(r.status)

        self.prefill_tasks.append(asyncio.create_task(prefill()))
        resp = await self._session.post(self._decode + api, json=decode_body)
        resp.raise_for_status()
        return resp


def _cap_single_token(body: dict, api: str) -> None:
    """llm-d's ``CapSingleToken``: one token, not streamed."""
    body["max_tokens"] = 1
    if "chat" in api:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body.pop("stream_options", None)


class DynamoVllm:
    """Dynamo's prefill and decode worker handlers in front of one prefill and one decode.
    ``prefill_config``: the prefill engine's ``VllmConfig`` as Dynamo's prefill worker holds it
    (its ``kv_transfer_config`` and ``parallel_config``)."""

    def __init__(self, session, prefill_url: str, decode_url: str, prefill_config: Any):
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
            get_mooncake_bootstrap_addr,
        )

        self._session, self._prefill, self._decode = session, prefill_url, decode_url
        host, port = get_mooncake_bootstrap_addr(prefill_config)  # vLLM's own helper
        self.bootstrap_addr = f"http://{host}:{port}"
        self.engine_id = prefill_config.kv_transfer_config.engine_id
        self.prefill_tasks: list[asyncio.Task] = []  # none: the prefill is awaited

    async def post(self, api: str, body: dict) -> aiohttp.ClientResponse:
        transfer_id = str(uuid.uuid4())
        prefill_body = dict(body)
        prefill_body["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        }
        prefill_body.update(max_tokens=1, min_tokens=1, stream=False)
        prefill_body.pop("max_completion_tokens", None)
        prefill_body.pop("stream_options", None)
        async with self._session.post(self._prefill + api, json=prefill_body) as r:
            r.raise_for_status()
            await r.read()
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": self.bootstrap_addr,
            "remote_engine_id": self.engine_id,
        }
        resp = await self._session.post(self._decode + api, json=decode_body)
        resp.raise_for_status()
        return resp


_NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class LlmdNixlV2:
    """llm-d's sidecar with ``--kv-connector nixlv2`` in front of one prefill and one decode."""

    def __init__(self, session, prefill_url: str, decode_url: str):
        self._session, self._prefill, self._decode = session, prefill_url, decode_url
        self.prefill_tasks: list[asyncio.Task] = []  # none: the prefill is awaited

    async def post(self, api: str, body: dict) -> aiohttp.ClientResponse:
        rid = str(uuid.uuid1())  # Go's uuid.NewUUID: version 1
        limits = ("max_tokens", "max_completion_tokens") if "chat" in api else ("max_tokens",)
        prefill_body = {**body, "kv_transfer_params": dict(_NIXL_PREFILL_PARAMS), "stream": False}
        prefill_body.pop("stream_options", None)
        prefill_body.update(dict.fromkeys(limits, 1))
        headers = {"X-Request-Id": rid}
        async with self._session.post(self._prefill + api, json=prefill_body, headers=headers) as r:
            r.raise_for_status()
            answer = await r.json()
        decode_body = {**body, "kv_transfer_params": answer.get("kv_transfer_params")}
        resp = await self._session.post(self._decode + api, json=decode_body, headers=headers)
        resp.raise_for_status()
        return resp


class RayServePD:
    """Ray Serve LLM's ``PDProxyServer`` in front of one prefill and one decode."""

    def __init__(self, session, prefill_url: str, decode_url: str):
        self._session, self._prefill, self._decode = session, prefill_url, decode_url
        self.prefill_tasks: list[asyncio.Task] = []

    async def post(self, api: str, body: dict) -> aiohttp.ClientResponse:
        body = {**body, "request_id": str(uuid.uuid4())}  # Serve's request id, on both legs
        prefill_body = {**body, "kv_transfer_params": dict(_NIXL_PREFILL_PARAMS)}
        prefill_body.update(max_tokens=1, stream=False)
        async with self._session.post(self._prefill + api, json=prefill_body) as r:
            r.raise_for_status()
            answer = await r.json()
        decode_body = {**body, "kv_transfer_params": answer["kv_transfer_params"]}
        resp = await self._session.post(self._decode + api, json=decode_body)
        resp.raise_for_status()
        return resp
