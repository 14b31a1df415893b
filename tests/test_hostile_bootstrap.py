"""A hostile or broken bootstrap service, as a consumer's resolver meets it over real TCP on
loopback: whatever it does, a resolve ends by its deadline with an error naming the bootstrap."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from mooncake_vllm.p2p import upstream
from mooncake_vllm.p2p.protocol import PendingHandoff

ENGINE = "prefill-engine-0"
ANSWER = json.dumps(upstream.query_body(ENGINE, 0, "127.0.0.1", [7001])).encode()


class RawHttpServer:
    """Answers each connection with ``response``, ``chunk`` bytes every ``pause_s``, until the
    client hangs up or the test ends."""

    def __init__(self, response: bytes, chunk: int = 1 << 20, pause_s: float = 0.0):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._response, self._chunk, self._pause_s = response, chunk, pause_s
        self._stop = threading.Event()
        self.sent = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.recv(65536)  # the request
            try:
                for i in range(0, len(self._response), self._chunk):
                    conn.sendall(self._response[i : i + self._chunk])
                    self.sent = i + self._chunk
                    if self._stop.wait(self._pause_s):
                        return
            except OSError:  # the client hung up
                return

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(timeout=5)


def http_response(body: bytes, status: str = "200 OK", headers: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}Connection: close\r\n\r\n"
    )
    return head.encode() + body


def resolve(addr: str, timeout_s: float) -> PendingHandoff:
    pending = PendingHandoff(transfer_id="ab" * 16, producer_engine_id=ENGINE, bootstrap_addr=addr)
    return upstream.BootstrapResolver().resolve(pending, timeout_s)


@pytest.fixture
def serve():
    servers: list[RawHttpServer] = []

    def start(*args, **kwargs) -> RawHttpServer:
        servers.append(RawHttpServer(*args, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_a_bootstrap_that_answers_at_once_is_resolved(serve):
    server = serve(http_response(ANSWER))
    resolved = resolve(server.addr, timeout_s=5)
    assert (resolved.side_channel_host, resolved.side_channel_ports) == ("127.0.0.1", [7001])


def test_a_trickling_bootstrap_is_cut_at_the_calls_deadline(serve):
    # A byte every 20 ms: every read comes well within any per-read timeout, and the whole
    # answer would take seconds. The call's deadline is one for the whole answer.
    response = http_response(ANSWER)
    server = serve(response, chunk=1, pause_s=0.02)
    with pytest.raises(upstream.BootstrapError, match=r"did not answer /query.*in 0\.3s"):
        resolve(server.addr, timeout_s=0.3)
    assert server.sent < len(response)  # cut before its last byte


@pytest.mark.parametrize(
    "response, why",
    [
        (http_response(b"", "302 Found", "Location: http://127.0.0.1:9/query\r\n"), "HTTP 302"),
        (http_response(b"{}", "500 Internal Server Error"), "HTTP 500"),
        (http_response(b" " * (upstream.MAX_QUERY_BYTES + 1)), "answer over"),
    ],
    ids=["redirect", "error status", "oversized"],
)
def test_a_bootstrap_answering_otherwise_than_200_and_bounded_is_named(serve, response, why):
    server = serve(response)
    with pytest.raises(upstream.BootstrapError, match=f"bootstrap {server.addr} .*{why}"):
        resolve(server.addr, timeout_s=5)
