"""Hosts apart on one machine: each part in its own network namespace, links that can be cut.

``Network`` makes a "switch" namespace holding a Linux bridge and, per host, a namespace joined
to the bridge by a veth pair, with one address from 198.18.0.0/24 (inside 198.18.0.0/15, the
range set aside for network benchmarks) on its veth and no route beyond that subnet. The root
namespace gets no address and no route: nothing the test starts can reach or leak out of the
test's network, and loopback is no longer the path between parts.

Faults, each undone by ``restore``:

* ``cut(host)``: the host's switch port goes down; it reaches no one and no one reaches it.
  Like a pulled cable: no reset, no ICMP, a TCP peer's reads wait until a timer fires.
* ``cut_between(a, b)``: only a↔b; ``one_way=True`` only a→b. Done without a packet filter
  (this kernel has neither iptables nor a tc classifier): ``a`` is told ``b``'s address is at a
  MAC address nobody owns, so its frames to ``b`` are flooded by the bridge and dropped by every
  host as meant for another. Silent, like a lost link.
* ``cap(host, rate)``: a token bucket (``tc tbf``) on the host's switch port, so traffic *to*
  the host is held to ``rate`` (``netem`` is not in this kernel).

Processes join a namespace by ``argv(host, [...])`` (``ip netns exec``). The test process reaches
them from the client namespace: ``entered(host)`` moves the *calling thread* into a host's
namespace (a network namespace is per thread) and back, and threads created meanwhile inherit it.

Everything is removed in ``close()``: on the context manager's exit (a failed test, Ctrl-C),
at interpreter exit, and, for namespaces of a process that was killed, by the next ``Network``.
Needs root and ``ip`` (iproute2); ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

SUBNET = ipaddress.ip_network("198.18.0.0/24")
_PREFIX = "mcv"  # namespace names: mcv<pid>-<host>; the pid lets a later run sweep stale ones
_NOBODY_MAC = "02:00:5e:00:53:01"  # locally administered, never a veth's
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2's ip and tc are not installed"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {done.stderr.strip()}")


def _sweep_stale() -> None:
    """Delete namespaces left by a run of this harness whose process is gone (a SIGKILL)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"({_PREFIX}(\d+)-\S+)", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            _ip("netns", "del", m.group(1), check=False)


@dataclass(frozen=True)
class Host:
    name: str
    ns: str
    address: str
    port_if: str  # its veth's end in the switch namespace
    mac: str


class Network:
    """A switch and hosts, each in its own network namespace (see the module docstring)."""

    def __init__(self) -> None:
        self.tag = f"{_PREFIX}{os.getpid()}"
        self.switch_ns = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._closed = True

    # ---- building ------------------------------------------------------------------------------

    def __enter__(self) -> Network:
        _sweep_stale()
        self._closed = False
        atexit.register(self.close)
        _ip("netns", "add", self.switch_ns)
        _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        for dev in ("lo", "br0"):
            _ip("-n", self.switch_ns, "link", "set", dev, "up")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        """A namespace joined to the switch, with the next address of ``SUBNET``."""
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", name) or name in self.hosts:
            raise ValueError(f"host name {name!r}: 1-10 of [a-z0-9], unique")
        ns, port_if = f"{self.tag}-{name}", f"p-{name}"
        address = str(SUBNET.network_address + len(self.hosts) + 1)
        _ip("netns", "add", ns)
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port_if,
            "netns", self.switch_ns)  # fmt: skip
        _ip("-n", self.switch_ns, "link", "set", port_if, "master", "br0")
        _ip("-n", self.switch_ns, "link", "set", port_if, "up")
        _ip("-n", ns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        for dev in ("lo", "eth0"):
            _ip("-n", ns, "link", "set", dev, "up")
        mac = _ip("-n", ns, "-br", "link", "show", "eth0").stdout.split()[2]
        host = Host(name, ns, address, port_if, mac)
        self.hosts[name] = host
        return host

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[host].ns, *argv]

    @contextlib.contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """The calling thread (and threads it starts meanwhile) in ``host``'s namespace."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.hosts[host].ns}", os.O_RDONLY)
        try:
            self._setns(target)
            try:
                yield
            finally:
                self._setns(own)
        finally:
            os.close(target)
            os.close(own)

    @staticmethod
    def _setns(fd: int) -> None:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns: {os.strerror(err)}")

    # ---- faults --------------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        """``host`` off the switch, both ways (its port down)."""
        _ip("-n", self.switch_ns, "link", "set", self.hosts[host].port_if, "down")

    def cut_between(self, a: str, b: str, one_way: bool = False) -> None:
        """Frames a→b (and b→a unless ``one_way``) go to a MAC address nobody owns."""
        pairs = [(a, b)] if one_way else [(a, b), (b, a)]
        for src, dst in pairs:
            _ip("-n", self.hosts[src].ns, "neigh", "replace", self.hosts[dst].address,
                "lladdr", _NOBODY_MAC, "dev", "eth0", "nud", "permanent")  # fmt: skip

    def cap(self, host: str, rate: str, burst: str = "256kb", latency: str = "100ms") -> None:
        """Traffic to ``host`` at most ``rate`` (tc's units: ``1gbit``), a token bucket."""
        _tc(self.switch_ns, "qdisc", "replace", "dev", self.hosts[host].port_if, "root", "tbf",
            "rate", rate, "burst", burst, "latency", latency)  # fmt: skip

    def restore(self, host: str) -> None:
        """Undo every fault touching ``host``: port up, no cap, true neighbours everywhere."""
        h = self.hosts[host]
        _ip("-n", self.switch_ns, "link", "set", h.port_if, "up")
        subprocess.run(["tc", "-n", self.switch_ns, "qdisc", "del", "dev", h.port_if, "root"],
                       capture_output=True)  # fmt: skip
        for other in self.hosts.values():
            for src, dst in ((h, other), (other, h)):
                if src is not dst:  # a stale entry is re-learnt by ARP
                    _ip("-n", src.ns, "neigh", "del", dst.address, "dev", "eth0", check=False)

    # ---- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Delete every namespace (their veths go with them). Processes still inside keep
        their namespace alive but unreachable; their owners stop them."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            _ip("netns", "del", host.ns, check=False)
        _ip("netns", "del", self.switch_ns, check=False)
        self.hosts.clear()
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
