"""Hosts as Linux network namespaces, each with a veth pair into one bridge (the launcher keeps an address there
and reaches every host). `cut(a, b)` makes the bridge silently drop every IP packet between two hosts, as a failed
link would (no reset, no ICMP: a connect times out, an open connection stalls); `heal(a, b)` restores them."""

# The drop: each bridge port (the veth's outer end) has an HTB root whose default class passes traffic and
# whose class 1:20 feeds a pfifo of length 0; a cut adds a u32 filter sending packets from the other host
# into it, on both hosts' ports. (HTB, pfifo and u32 are what minimal kernels have; netem and tc actions
# often are not.)

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence

from libs.launch.mesh import Host


def unavailable() -> str | None:
    """Why a Network cannot be made here (None when it can): Linux, root, iproute2, a trial cut and heal."""
    if not os.path.isdir("/proc/self/ns") or shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs Linux with iproute2 (`ip`, `tc`) on PATH"
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces"
    try:
        with Network(("a", "b")) as net:
            net.cut("a", "b")
            net.heal("a", "b")
    except RuntimeError as e:
        return f"cannot build a test network here: {e}"
    return None


def _ip(*args: str, netns: str = "") -> None:
    _run(["ip", *(("-n", netns) if netns else ()), *args])


def _tc(*args: str) -> None:
    _run(["tc", *args])


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def _free_subnet() -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, timeout=10).stdout
    for _ in range(100):
        net = ipaddress.IPv4Network(f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}.0/24")
        if str(net.network_address).rsplit(".", 1)[0] + "." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the test network")


class Network:
    """Use as a context manager; names carry a random tag, so networks of parallel runs never meet."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"mm{self.tag}br"
        self.subnet = _free_subnet()
        addrs = list(self.subnet.hosts())
        self.gateway_address = str(addrs[0])  # the bridge's own: the launcher's namespace
        self.hosts = {h: Host(str(addrs[i + 1]), f"mm{self.tag}-{h}") for i, h in enumerate(hosts)}
        self._port = {h: f"mm{self.tag}o{i}" for i, h in enumerate(hosts)}  # its bridge port
        self._cuts: set[frozenset[str]] = set()
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name) to remove, in reverse

    def __enter__(self) -> Network:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        plen = self.subnet.prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.gateway_address}/{plen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (name, host) in enumerate(self.hosts.items()):
            _ip("netns", "add", host.netns)
            self._made.append(("netns", host.netns))
            outer, inner = self._port[name], f"mm{self.tag}i{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made.append(("link", outer))  # deleting one end deletes the pair
            _ip("link", "set", inner, "netns", host.netns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _tc("qdisc", "add", "dev", outer, "root", "handle", "1:", "htb", "default", "10")
            for cls in ("1:10", "1:20"):
                _tc("class", "add", "dev", outer, "parent", "1:", "classid", cls, "htb", "rate", "100gbit")
            _tc("qdisc", "add", "dev", outer, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
            _ip("link", "set", "lo", "up", netns=host.netns)
            _ip("addr", "add", f"{host.address}/{plen}", "dev", inner, netns=host.netns)
            _ip("link", "set", inner, "up", netns=host.netns)

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def _prio(self, host: str) -> str:
        return str(list(self.hosts).index(host) + 1)  # one filter per (port, peer)

    def cut(self, a: str, b: str) -> None:
        """Drop every IP packet between hosts a and b (both ways) until `heal(a, b)`."""
        for to, frm in ((a, b), (b, a)):
            _tc("filter", "add", "dev", self._port[to], "parent", "1:", "protocol", "ip", "prio", self._prio(frm),
                "u32", "match", "ip", "src", f"{self.hosts[frm].address}/32", "flowid", "1:20")  # fmt: skip
        self._cuts.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        for to, frm in ((a, b), (b, a)):
            _tc("filter", "del", "dev", self._port[to], "parent", "1:", "prio", self._prio(frm))
        self._cuts.discard(frozenset((a, b)))

    def heal_all(self) -> None:
        for pair in list(self._cuts):
            self.heal(*sorted(pair))

    def close(self) -> None:
        """Remove the namespaces and links (safe to call twice; processes still inside lose their network)."""
        while self._made:
            kind, name = self._made.pop()
            with contextlib.suppress(RuntimeError):  # already gone (a veth goes with its namespace)
                _ip("netns", "del", name) if kind == "netns" else _ip("link", "del", name)
