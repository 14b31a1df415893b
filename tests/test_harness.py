"""The harness itself: real redis, etcd and a plain vLLM server on loopback."""

import socket
import time

import pytest

from harness import servers

pytestmark = pytest.mark.servers


def _gone(pid: int) -> bool:
    """No such process, or only a zombie left for init to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _redis_cmd(port: int, *parts: str) -> bytes:
    payload = f"*{len(parts)}\r\n".encode() + b"".join(
        f"${len(p.encode())}\r\n{p}\r\n".encode() for p in parts
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        return s.recv(4096)


def test_redis_round_trips_a_key():
    with servers.running(servers.start_redis()) as redis:
        assert _redis_cmd(redis.port, "SET", "k", "v1") == b"+OK\r\n"
        assert _redis_cmd(redis.port, "GET", "k") == b"$2\r\nv1\r\n"
        pid = redis.process.proc.pid
    assert _gone(pid)


def test_etcd_round_trips_a_key():
    import base64

    with servers.running(servers.start_etcd()) as etcd:
        url = f"http://127.0.0.1:{etcd.port}/v3/kv"
        key, val = base64.b64encode(b"mooncake/k").decode(), base64.b64encode(b"v2").decode()
        servers.http_json(f"{url}/put", {"key": key, "value": val})
        got = servers.http_json(f"{url}/range", {"key": key})
        assert base64.b64decode(got["kvs"][0]["value"]) == b"v2"


def test_failed_start_reports_the_log(tmp_path):
    proc = servers.ManagedProcess(
        "boom", ["python3", "-c", "print('bad flag'); raise SystemExit(3)"], tmp_path / "boom.log"
    ).start()
    with pytest.raises(servers.ServerStartError, match=r"(?s)code 3.*bad flag"):
        proc.wait_until(lambda: False, 30, "ready")


def test_stop_kills_the_whole_process_group(tmp_path):
    # A parent that spawns a child which ignores SIGTERM: stop() must still leave nothing.
    script = (
        "import subprocess, sys, time;"
        "c = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']);"
        "print(c.pid, flush=True); time.sleep(600)"
    )
    proc = servers.ManagedProcess("tree", ["python3", "-c", script], tmp_path / "t.log").start()
    proc.wait_until(lambda: proc.log_tail().strip() != "", 30, "spawned")
    child = int(proc.log_tail().split()[0])
    assert not _gone(child)
    proc.stop(grace_s=1)
    deadline = time.monotonic() + 5  # the kernel reaps the killed child shortly after stop()
    while not _gone(child):
        assert time.monotonic() < deadline, f"child {child} outlived stop()"
        time.sleep(0.05)


def test_plain_vllm_greedy_is_deterministic(pd):
    srv = pd.plain
    before = srv.metric("vllm:prompt_tokens_total")
    body = {
        "model": pd.model,
        "prompt": "the cache block moves",
        "max_tokens": 16,
        "temperature": 0,
    }
    a = servers.http_json(f"{srv.url}/v1/completions", body)
    b = servers.http_json(f"{srv.url}/v1/completions", body)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] == 16
    # The API process counts a request's prompt tokens as it returns the answer.
    counted = srv.metric("vllm:prompt_tokens_total") - before
    assert counted == a["usage"]["prompt_tokens"] + b["usage"]["prompt_tokens"]
