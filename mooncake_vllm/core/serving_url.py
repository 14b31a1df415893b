"""The OpenAI base URL an engine publishes for discovery (``advertise_url``), and its default.

The connector runs inside vLLM's engine-core or worker processes, which are not told where the
API server listens. The default therefore comes from the API server's own command line, found by
walking up the process tree: ``--host``/``--port`` of ``vllm serve`` or
``python -m vllm.entrypoints.openai.api_server`` (vLLM's defaults: all interfaces, port 8000). A
host that means "all interfaces" (absent, ``0.0.0.0``, ``::``) is replaced by the address the
connector advertises for transfers (``local_hostname`` or its url's host), which peers can reach.
When no such process is found (an offline ``LLM``, a custom launcher), there is no default: the
engine is not published for discovery and says so once in its log.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_VLLM_DEFAULT_PORT = 8000
_ALL_INTERFACES = ("", "0.0.0.0", "::", "[::]")
# engine-core → API server is one step; a worker under an engine core two. Stop a bit above.
_MAX_ANCESTORS = 4


def normalize_advertise_url(url: str) -> str:
    """``http(s)://HOST:PORT`` without a trailing slash; ValueError names the accepted form."""
    expected = "expected 'http://HOST:PORT' (the engine's OpenAI server, reachable by the proxy)"
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{url!r} is not a URL ({e}); {expected}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"{url!r} has no scheme, host or port; {expected}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{url!r} has a path, query or credentials; {expected}")
    if parts.hostname in _ALL_INTERFACES:
        raise ValueError(f"{url!r} names no host a proxy can reach; {expected}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


def _option(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` (the last one wins, as with argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def is_vllm_api_server(argv: Sequence[str]) -> bool:
    if _API_SERVER_MODULE in argv:  # python -m vllm.entrypoints.openai.api_server
        return True
    # vllm serve ... (the console script; or python .../vllm serve)
    return any(
        Path(arg).name == "vllm" and list(argv[i + 1 : i + 2]) == ["serve"]
        for i, arg in enumerate(argv)
    )


def url_from_vllm_argv(argv: Sequence[str], fallback_host: str) -> str | None:
    """The URL a vLLM API server with this command line serves on; None if it is not one."""
    if not is_vllm_api_server(argv):
        return None
    host = _option(argv, "--host") or ""
    if host in _ALL_INTERFACES:
        host = fallback_host
    port = _option(argv, "--port") or str(_VLLM_DEFAULT_PORT)
    scheme = "https" if _option(argv, "--ssl-certfile") else "http"
    try:
        return normalize_advertise_url(f"{scheme}://{host}:{port}")
    except ValueError:
        return None


def _cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])  # field 4, ppid


def find_serving_url(fallback_host: str, pid: int | None = None) -> str | None:
    """The API server URL from this process's nearest vLLM API-server ancestor (itself
    included), or None when there is none (or /proc cannot tell)."""
    pid = os.getpid() if pid is None else pid
    for _ in range(_MAX_ANCESTORS + 1):
        if pid <= 1:
            return None
        try:
            url = url_from_vllm_argv(_cmdline(pid), fallback_host)
            if url is not None:
                return url
            pid = _parent(pid)
        except (OSError, ValueError, IndexError):
            return None
    return None
