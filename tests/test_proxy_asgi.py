"""``asgi.GenerationDoor`` driven by ASGI messages, no server: what it serves itself, what it
passes on to Quart, and what a body that is too large or a client that leaves does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from mooncake_vllm.proxy.asgi import Admitted, Answer, GenerationDoor, Incoming


class Gate:
    def __init__(self) -> None:
        self.counted: list[tuple[str, int]] = []

    def admit(self, path, authorization, request_id, remote_addr) -> Admitted:
        return Admitted(request_id or "generated-id", 0.0)

    def count(self, endpoint: str, status: int) -> None:
        self.counted.append((endpoint, status))


def _scope(path: str = "/v1/completions", method: str = "POST", headers=()) -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(b"x-request-id", b"req-1"), *headers],
        "client": ("127.0.0.1", 5000),
    }


class Client:
    """The ASGI server's side: the request's messages in, the answer's messages out."""

    def __init__(self, *bodies: bytes, then_disconnect: asyncio.Event | None = None) -> None:
        self._messages = [
            {"type": "http.request", "body": b, "more_body": i < len(bodies) - 1}
            for i, b in enumerate(bodies)
        ]
        self._then_disconnect = then_disconnect or asyncio.Event()
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self._messages:
            return self._messages.pop(0)
        await self._then_disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


def _door(handler, passed_on: list | None = None, max_body_bytes: int = 100) -> GenerationDoor:
    async def quart(scope, receive, send) -> None:
        assert passed_on is not None
        passed_on.append(scope["path"])

    return GenerationDoor(quart, Gate(), handler, max_body_bytes=max_body_bytes, body_timeout_s=5.0)


async def _echo(incoming: Incoming, admitted: Admitted) -> Answer:
    return Answer(200, b"got " + incoming.body)


async def test_generation_paths_are_served_with_the_request_id_and_counted():
    door = _door(_echo)
    client = Client(b'{"prompt":', b'"x"}')
    await door(_scope(), client.receive, client.send)
    assert client.status == 200
    assert client.body == b'got {"prompt":"x"}'
    assert client.headers[b"x-request-id"] == b"req-1"
    assert client.headers[b"content-length"] == b"18"
    assert door._gate.counted == [("/v1/completions", 200)]


async def test_other_paths_go_on_to_quart():
    passed_on: list[str] = []
    door = _door(_echo, passed_on)
    for path in ("/health", "/v1/models", "/v1/completions/"):
        await door(_scope(path, "GET"), Client().receive, Client().send)
    assert passed_on == ["/health", "/v1/models", "/v1/completions/"]


async def test_a_body_over_the_limit_gets_413_before_the_handler():
    called = []

    async def handler(incoming, admitted):
        called.append(incoming)
        return Answer(200, b"")

    door = _door(handler, max_body_bytes=10)
    client = Client(b"x" * 6, b"x" * 6)  # no Content-Length: found while reading
    await door(_scope(), client.receive, client.send)
    assert client.status == 413
    assert "--max-body-bytes" in json.loads(client.body)["error"]["message"]
    declared = Client(b"x")
    await door(_scope(headers=[(b"content-length", b"11")]), declared.receive, declared.send)
    assert declared.status == 413
    assert called == []


async def test_other_methods_get_405():
    door = _door(_echo)
    client = Client(b"")
    await door(_scope(method="GET"), client.receive, client.send)
    assert client.status == 405
    assert json.loads(client.body)["error"]["type"] == "invalid_request_error"


async def test_a_client_that_leaves_cancels_the_handler_quietly():
    gone = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow(incoming, admitted):
        try:
            await asyncio.Event().wait()  # a decode that takes its time
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Answer(200, b"")

    door = _door(slow)
    client = Client(b"{}", then_disconnect=gone)
    serving = asyncio.create_task(door(_scope(), client.receive, client.send))
    await asyncio.sleep(0.01)
    gone.set()
    await asyncio.wait_for(serving, timeout=2)  # returns, does not raise
    assert cancelled.is_set()
    assert not serving.cancelled()
    assert client.sent == []


async def test_a_stream_ends_with_the_client_and_is_closed():
    gone = asyncio.Event()

    class Endless:
        closed = False

        def __aiter__(self):
            return self

        async def __anext__(self) -> bytes:
            await asyncio.sleep(0.005)
            return b"data: {}\n\n"

        async def aclose(self) -> None:
            Endless.closed = True

    async def handler(incoming, admitted):
        return Answer.event_stream(200, Endless())

    door = _door(handler)
    client = Client(b"{}", then_disconnect=gone)
    serving = asyncio.create_task(door(_scope(), client.receive, client.send))
    await asyncio.sleep(0.05)
    gone.set()
    await asyncio.wait_for(serving, timeout=2)
    assert Endless.closed
    assert client.headers[b"content-type"] == b"text/event-stream"
    assert client.headers[b"cache-control"] == b"no-cache"
    assert client.body.startswith(b"data: {}\n\n")
