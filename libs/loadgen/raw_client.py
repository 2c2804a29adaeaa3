"""A lean streaming client for http:// servers: HTTP/1.1 on keep-alive asyncio connections, no HTTP library.
`RawClient.send` makes the same record `client.send` would of the same stream; `RawConnection.request`
streams any POST for other probes (bench.scale_load)."""

# It exists because httpx's CPU per streamed SSE event (h11, httpcore, anyio, a coroutine hop per line) caps
# one client process below what one GPU decodes (bench/loadgen_cost.py). Each connection is an asyncio
# Protocol feeding httptools (llhttp); SSE lines are cut in place, each `data:` event decoded with msgspec and
# judged by `client.parse_chunk`; no await per event. A pooled connection found closed before any byte of
# the answer is retried once on a fresh one, as httpx does. TCP_QUICKACK is re-armed after every write and
# read: a reused connection otherwise falls into delayed-ACK mode, and a server with Nagle on then holds its
# first SSE event behind the unacknowledged response head until the delayed-ACK timer fires.

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httptools
import msgspec

from libs.loadgen.client import Endpoint, finish_record, parse_chunk, record_chunk, request_body
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.stats import RequestRecord

_json = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode
_ERROR_BODY_LIMIT = 64 * 1024  # kept of a refused request's body (500 characters reach the record)
_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only; elsewhere the kernel's ACK policy stands


class BodySink(Protocol):
    """Where one response goes: its status once the headers are in, then the body bytes as they come."""

    def on_status(self, status: int) -> None: ...

    def on_body(self, data: bytes) -> None: ...


class RawConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.sock: Any = None  # the transport's socket (uvloop: a pseudo-socket) for TCP_QUICKACK
        self.sink: BodySink | None = None
        self.done: asyncio.Future[None] | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.got_bytes = False
        self.closed = False
        self.keep_alive = False

    @classmethod
    async def open(cls, host: str, port: int) -> RawConnection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, host, port)
        return conn

    async def request(self, head: bytes, body: bytes, sink: BodySink) -> None:
        """Send one request and wait until its whole response went into `sink`; ConnectionError when the
        connection ends first."""
        if self.closed or self.transport is None:
            raise ConnectionError("the connection is closed")
        self.sink, self.got_bytes = sink, False
        self.parser = httptools.HttpResponseParser(self)
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        self._quickack()
        try:
            await self.done
        finally:
            self.sink = self.done = self.parser = None

    def _quickack(self) -> None:
        """ACK what has come in now and leave delayed-ACK mode (the kernel may re-enter it: call per I/O)."""
        if self.sock is not None and _QUICKACK is not None:
            try:
                self.sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
            except OSError:
                self.sock = None  # not a TCP socket after all

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self.sock = transport.get_extra_info("socket")

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._quickack()
        if self.parser is None:
            self.close()  # bytes nobody asked for: the connection's framing is lost
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"malformed HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(
            ConnectionError(f"the server closed the connection mid-response{f': {exc}' if exc else ''}")
        )

    def _fail(self, exc: Exception) -> None:
        self.close()
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc)

    # httptools callbacks
    def on_headers_complete(self) -> None:
        assert self.sink is not None and self.parser is not None
        self.sink.on_status(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink.on_body(body)

    def on_message_complete(self) -> None:
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


class SseRecorder:
    """Turns one streamed completion into a RequestRecord, event by event, as `client.send` does."""

    def __init__(self, rec: RequestRecord, chat: bool, clock: Callable[[], float]) -> None:
        self.rec, self.chat, self.clock = rec, chat, clock
        self.status = 0
        self.usage: dict[str, Any] | None = None
        self.tail = b""  # an incomplete line carried over to the next read
        self.error_body = bytearray()
        self.stopped = False  # [DONE] seen, or a bad event: what follows is not read

    def on_status(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes) -> None:
        if self.status != 200:
            if len(self.error_body) < _ERROR_BODY_LIMIT:
                self.error_body += data
            return
        if self.stopped:
            return
        lines = (self.tail + data).split(b"\n") if self.tail else data.split(b"\n")
        self.tail = lines.pop()
        for line in lines:
            if line.startswith(b"data:") and self._event(line[5:].strip()):
                self.stopped = True
                return

    def _event(self, payload: bytes) -> bool:
        """One `data:` payload; True when the stream is over for the client."""
        if payload == b"[DONE]":
            return True
        try:
            chunk = parse_chunk(_json.decode(payload), self.chat)
        except (ValueError, TypeError, AttributeError) as e:
            self.rec.error = f"{type(e).__name__}: {e}"
            return True
        record_chunk(self.rec, chunk, self.clock())
        self.usage = chunk.usage or self.usage
        return False

    def finish(self) -> None:
        if self.status != 200 and not self.rec.error:
            text = bytes(self.error_body).decode("utf-8", "replace")
            self.rec.error = f"HTTP {self.status}: {text[:500]}"
        finish_record(self.rec, self.usage, self.clock())


class RawClient:
    """Keep-alive connections to one http:// server, opened as requests need them (the caller bounds the
    concurrency), at most `keep` of them idle between requests."""

    def __init__(self, base_url: str, keep: int = 64) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"the raw client speaks plain http:// (use the httpx client for {base_url!r})")
        self.host, self.port = url.hostname, url.port or 80
        self.authority = url.netloc
        self.keep = keep
        self.idle: list[RawConnection] = []
        self._heads: dict[tuple[str, str], bytes] = {}

    def head(self, path: str, length: int, headers: dict[str, str]) -> bytes:
        key = (path, repr(sorted(headers.items())))
        prefix = self._heads.get(key)
        if prefix is None:
            extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            prefix = self._heads[key] = (
                f"POST {path} HTTP/1.1\r\nHost: {self.authority}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\n{extra}Content-Length: "
            ).encode()
        return prefix + b"%d\r\n\r\n" % length

    async def post(self, path: str, body: bytes, headers: dict[str, str], sink: BodySink) -> None:
        """One POST on a pooled connection (a fresh one when a pooled one was found closed)."""
        for attempt in range(2):
            reused = bool(self.idle) and attempt == 0
            conn = self.idle.pop() if reused else await RawConnection.open(self.host, self.port)
            try:
                await conn.request(self.head(path, len(body), headers), body, sink)
            except ConnectionError:
                conn.close()
                if reused and not conn.got_bytes:
                    continue  # the server had closed the idle connection: nothing of ours was answered
                raise
            except BaseException:
                conn.close()  # cancelled mid-response: the rest of the stream would be read by no one
                raise
            if conn.keep_alive and not conn.closed and len(self.idle) < self.keep:
                self.idle.append(conn)
            else:
                conn.close()
            return

    async def send(
        self, ep: Endpoint, req: BenchRequest, index: int, clock: Callable[[], float]
    ) -> RequestRecord:
        """`client.send` over this client: stream one request, never raise for a failed one."""
        body = _encode(request_body(ep, req))
        rec = RequestRecord(index=index, start=clock(), prompt_tokens=req.input_len)
        sink = SseRecorder(rec, ep.chat, clock)
        try:
            await self.post(urlsplit(ep.url).path, body, ep.headers(), sink)
        except (OSError, ValueError) as e:  # ConnectionError is an OSError
            rec.error = rec.error or f"{type(e).__name__}: {e}"
        sink.finish()
        return rec

    async def aclose(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()
