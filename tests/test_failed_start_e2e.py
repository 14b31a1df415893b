"""An engine whose connector refuses its configuration exits promptly, saying why.

The case that used to linger: a producer whose bootstrap port was set and is taken. Our
scheduler half refuses it in vLLM's engine core, after the workers started; the engine core then
terminates its workers and waits for them, and a producer's worker holds the first SIGTERM of a
group signal (``vllm_glue.outlive_group_signal``). Before the engine core has started the hold
is off (``arm_group_signal_hold``), so the worker exits and the engine with it: the engine core's
last error line is the refusal, vLLM's API server then prints its own traceback. (A bad config
that the worker refuses, an unreachable store, is ``test_metadata_e2e``'s.)
"""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

from harness.pd import kv_args, mooncake_json
from harness.servers import ServerStartError, free_port, start_vllm

pytestmark = pytest.mark.servers

FAILED = "EngineCore failed to start"
PROMPTLY_S = 30.0


def test_a_producer_whose_bootstrap_port_is_taken_exits_within_30s_naming_it(tiny_model, tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    cfg = mooncake_json(
        tmp_path / "mooncake.json",
        prefill_url="127.0.0.1:13380",
        decode_url="127.0.0.1:13390",
        bootstrap_port=port,
    )
    api_port = free_port()
    log = tmp_path / f"taken-port-127.0.0.1-{api_port}.log"
    failed_at: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if log.exists() and FAILED in log.read_text(errors="replace"):
                failed_at.append(time.monotonic())
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with pytest.raises(ServerStartError) as exc:
            start_vllm(
                tiny_model,
                name="taken-port",
                port=api_port,
                args=kv_args("kv_producer"),
                env={"MOONCAKE_CONFIG_PATH": str(cfg)},
                log_dir=tmp_path,
                timeout_s=600,
            ).stop()
        exited_at = time.monotonic()
    finally:
        done.set()
        watcher.join()
        taken.close()
    message = str(exc.value)
    assert "exited with code" in message, message[-3000:]  # by itself, not at the deadline
    assert failed_at, f"no {FAILED!r} in the log"
    took = exited_at - failed_at[0]
    print(f"\nexited {took:.1f} s after its engine core failed to start")
    assert took < PROMPTLY_S, took
    # What it says: the last line of the engine core's "failed to start" traceback names the
    # port and the settings that choose it (then vLLM's executor reports its worker's exit, and
    # vLLM's API server prints its own "Engine core initialization failed" traceback).
    text = log.read_text(errors="replace")
    core_lines = [
        line
        for line in text.splitlines()
        if line.startswith("(EngineCore") and " ERROR " in line and "[core.py" in line
    ]
    assert re.search(rf"cannot listen on 127\.0\.0\.1:{port} .*bootstrap_port", core_lines[-1]), (
        core_lines[-5:]
    )
    assert "keeps serving while the engine core drains" not in text
