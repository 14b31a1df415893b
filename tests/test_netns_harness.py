"""harness.netns on its own (no vLLM, about a second): namespaces joined by a bridge, a TCP echo
across them, and each fault seen by a real socket; plus the tbf rate parsing of
benchmarks.transfer."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from benchmarks.transfer import _tc_rate_bit_s
from harness import netns

ECHO = (
    "import socket\n"
    "s = socket.create_server(('0.0.0.0', 9000))\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(c.recv(1)); c.close()\n"
)


@pytest.mark.parametrize(
    ("rate", "bit_s"),
    [("1gbit", 1e9), ("500mbit", 5e8), ("100kbit", 1e5), ("8bit", 8.0), ("1GBIT", 1e9)],
)
def test_tc_rate_units(rate, bit_s):
    assert _tc_rate_bit_s(rate) == bit_s


@pytest.mark.parametrize("rate", ["1gbps", "fast", "1g"])
def test_tc_rate_refuses_other_forms_naming_the_flag(rate):
    with pytest.raises(ValueError, match="--tbf-rate"):
        _tc_rate_bit_s(rate)


def _echo(net: netns.Network, src: str, dst: str) -> str:
    """One byte to ``dst``'s echo server from ``src``'s namespace: "ok" or the error's name."""
    with net.entered(src), socket.socket() as s:
        s.settimeout(1.0)
        try:
            s.connect((net.hosts[dst].address, 9000))
            s.sendall(b"x")
            return "ok" if s.recv(1) == b"x" else "bad echo"
        except OSError as e:
            return type(e).__name__


@pytest.mark.skipif((why := netns.unavailable()) is not None, reason=f"no namespaces: {why}")
def test_faults_cut_what_they_say_and_restore_undoes_them():
    with netns.Network() as net:
        for name in ("a", "b", "c"):
            net.add_host(name)
        names = [h.ns for h in net.hosts.values()]
        server = subprocess.Popen(net.argv("b", [sys.executable, "-c", ECHO]))
        try:
            deadline = time.monotonic() + 10
            while _echo(net, "a", "b") != "ok":
                assert time.monotonic() < deadline, "echo server never answered"
                time.sleep(0.1)
            net.cut("b")
            assert (_echo(net, "a", "b"), _echo(net, "c", "b")) == ("TimeoutError",) * 2
            net.restore("b")
            assert _echo(net, "a", "b") == "ok"
            net.cut_between("a", "b")
            assert (_echo(net, "a", "b"), _echo(net, "c", "b")) == ("TimeoutError", "ok")
            net.restore("b")
            net.cut_between("b", "a", one_way=True)  # a's SYN arrives, b's answer is lost
            assert (_echo(net, "a", "b"), _echo(net, "c", "b")) == ("TimeoutError", "ok")
            net.restore("a")
            assert _echo(net, "a", "b") == "ok"
        finally:
            server.kill()
            server.wait()
        # No address of the test's range in the root namespace.
        assert (
            "198.18."
            not in subprocess.run(["ip", "-4", "addr"], capture_output=True).stdout.decode()
        )
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in [*names, net.switch_ns])
