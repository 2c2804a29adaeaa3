"""The /proc reader the bind test relies on sees this process's own listeners as bound."""

from __future__ import annotations

import os
import socket

from tests.e2e import listening


def test_listeners_of_this_process_with_their_addresses() -> None:
    socks = []
    try:
        for family, kind, addr in (
            (socket.AF_INET, socket.SOCK_STREAM, "127.0.0.1"),
            (socket.AF_INET, socket.SOCK_STREAM, "0.0.0.0"),
            (socket.AF_INET6, socket.SOCK_STREAM, "::"),
            (socket.AF_INET, socket.SOCK_DGRAM, "0.0.0.0"),
        ):
            s = socket.socket(family, kind)
            socks.append(s)
            s.bind((addr, 0))
            if kind == socket.SOCK_STREAM:
                s.listen()
        connected = socket.create_connection(socks[0].getsockname())  # a connection is no listener
        socks.append(connected)
        got = {(x.proto, x.address, x.port) for x in listening.listening([os.getpid()])}
        want = {
            ("tcp", "127.0.0.1", socks[0].getsockname()[1]),
            ("tcp", "0.0.0.0", socks[1].getsockname()[1]),
            ("tcp6", "::", socks[2].getsockname()[1]),
            ("udp", "0.0.0.0", socks[3].getsockname()[1]),
        }
        assert want <= got  # other tests' servers may listen in this process too
        assert not {x for x in got if x[2] == connected.getsockname()[1]}
        assert os.getpid() in listening.group_pids(os.getpgid(0))
    finally:
        for s in socks:
            s.close()
