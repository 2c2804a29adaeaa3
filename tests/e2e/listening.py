"""The listening sockets of a process group (a launched service and whatever it spawned), read from /proc:
Linux only, and only sockets of the reader's own network namespace."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

WILDCARDS = frozenset({"0.0.0.0", "::"})
_LISTEN, _UNCONNECTED = "0A", "07"  # TCP LISTEN; a UDP socket with no peer (ss -lu's UNCONN)


@dataclass(frozen=True)
class Listener:
    pid: int
    proto: str  # tcp, tcp6, udp, udp6
    address: str
    port: int

    @property
    def wildcard(self) -> bool:
        return self.address in WILDCARDS


def group_pids(pgid: int) -> list[int]:
    """Every process whose process group is `pgid` (a service started in a session of its own)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue  # it exited while we looked
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                out.append(int(d.name))
    return out


def _address(hexaddr: str) -> tuple[str, int]:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    # the kernel prints each 32-bit word in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(target[8:-1])
    except OSError:
        pass
    return out


def listening(pids: list[int]) -> list[Listener]:
    """The TCP sockets in LISTEN and the bound, unconnected UDP sockets these processes hold."""
    owner = {inode: pid for pid in pids for inode in _inodes(pid)}
    out = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local, remote, state, inode = f[1], f[2], f[3], f[9]
            if inode not in owner or state != (_LISTEN if proto.startswith("tcp") else _UNCONNECTED):
                continue
            if proto.startswith("udp") and _address(remote)[1] != 0:
                continue
            address, port = _address(local)
            out.append(Listener(owner[inode], proto, address, port))
    return out
