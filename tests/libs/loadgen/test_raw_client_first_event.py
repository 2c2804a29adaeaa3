"""The raw client sees a stream's first event as soon as httpx does, against a server that leaves Nagle's
algorithm on and writes the response head and the first SSE event in separate small writes: a reused
keep-alive connection must not hold the event behind a delayed ACK of the head."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from libs.loadgen.client import Endpoint, HttpxClient, StreamClient
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.raw_client import RawClient

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="delayed-ACK behaviour of the Linux stack")

EVENT = b"data: " + json.dumps({"choices": [{"index": 0, "text": "a"}]}).encode() + b"\n\n"
REST = b"data: [DONE]\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass
class NagleServer:
    """Answers every request with a head, then (a separate write) one event, then waits until the client
    has read that event before it ends the stream; `written` holds each first event's write time."""

    port: int = 0
    written: list[float] = field(default_factory=list)
    seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length")
                )
                await reader.readexactly(length)
                self.seen.clear()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                await writer.drain()
                self.written.append(time.monotonic())
                writer.write(_chunk(EVENT))
                await asyncio.wait_for(self.seen.wait(), 5.0)
                writer.write(_chunk(REST) + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.fixture
async def server() -> AsyncIterator[NagleServer]:
    fake = NagleServer()
    srv = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield fake


async def _lags(client: StreamClient, server: NagleServer, n: int) -> list[float]:
    """Seconds from the server's write of the first event to the client's record of it, per request."""
    ep = Endpoint(f"http://127.0.0.1:{server.port}", model="m")
    calls = 0

    def clock() -> float:  # called once at a request's start, then once per event read
        nonlocal calls
        calls += 1
        if calls % 2 == 0:
            server.seen.set()
        return time.monotonic()

    lags = []
    try:
        for i in range(n):
            rec = await client.send(ep, BenchRequest([1, 2, 3], 3, 1), i, clock)
            assert rec.ok, rec.error
            lags.append(rec.chunk_times[0] - server.written[-1])
            calls = 0
    finally:
        await client.aclose()
    return lags


async def test_raw_client_sees_the_first_event_when_httpx_does(server: NagleServer) -> None:
    raw = await _lags(RawClient(f"http://127.0.0.1:{server.port}"), server, 4)
    httpx = await _lags(HttpxClient(2), server, 4)
    # the best of each (scheduling noise only adds); raw's first request opens the connection it then reuses
    assert abs(min(raw[1:]) - min(httpx)) < 1e-3, (raw, httpx)
