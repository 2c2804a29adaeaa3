"""The raw streaming client against a real HTTP server (asyncio, in the test, on a loopback port): the same
records as httpx `send` for a chunked SSE stream whose events are split over HTTP chunks and writes, an
error event, a 4xx with an OpenAI error body and a stream cut short; keep-alive reuse; SSE lines split at
every byte."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from libs.loadgen.benchmark import Clients
from libs.loadgen.client import Endpoint, HttpxClient, StreamClient, run_clock
from libs.loadgen.datasets import BenchRequest
from libs.loadgen.raw_client import RawClient, SseRecorder
from libs.loadgen.stats import RequestRecord


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _text(t: str, tokens: int = 0) -> dict:
    choice: dict = {"index": 0, "text": t, "finish_reason": None}
    if tokens:
        choice["logprobs"] = {"tokens": [t] * tokens, "token_logprobs": [-0.5] * tokens}
    return {"id": "c", "object": "text_completion", "choices": [choice]}


USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass
class FakeServer:
    """An OpenAI completions server of a few canned answers, chosen by the first prompt id."""

    port: int = 0
    connections: int = 0
    bodies: list[dict] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length")
                )
                body = json.loads(await reader.readexactly(length))
                self.bodies.append(body)
                if not await self.answer(body["prompt"][0], writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def answer(self, kind: int, w: asyncio.StreamWriter) -> bool:
        """Writes one response; False when the connection is to be cut."""
        if kind == 4:  # refused: a 4xx with an OpenAI error body and a length
            err = json.dumps(
                {"error": {"message": "prompt too long", "type": "invalid_request_error"}}
            ).encode()
            w.write(
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(err), err)
            )
            await w.drain()
            return True
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        events = [_event({"choices": [{"index": 0, "text": ""}]}), _event(_text("a")), _event(_text("bc", 2))]
        if kind == 2:
            events.append(_event({"error": {"message": "worker died", "code": 503}}))
        else:
            events += [_event(_text("d")), _event(_text("e", 2))]
        events.append(_event(USAGE) if kind != 2 else b"")
        whole = b"".join(events) + b"data: [DONE]\n\n"
        cut = len(events[0]) + len(events[1]) + 9  # inside the third event's JSON
        w.write(_chunk(whole[:cut]))
        await w.drain()  # the event's two halves go in separate writes and separate HTTP chunks
        if kind == 3:  # the stream ends before the response does
            return False
        rest = whole[cut:]
        # several events and HTTP chunks in one write, an SSE comment, then the last chunk
        w.write(_chunk(rest[:20]) + _chunk(rest[20:]) + _chunk(b": a comment line\n\n") + b"0\r\n\r\n")
        await w.drain()
        return True


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    fake = FakeServer()
    srv = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield fake


async def _records(client: StreamClient, ep: Endpoint, kinds: list[int]) -> list[RequestRecord]:
    clock = run_clock()
    try:
        return [await client.send(ep, BenchRequest([k, 7, 7], 3, 5), i, clock) for i, k in enumerate(kinds)]
    finally:
        await client.aclose()


def _seen(r: RequestRecord) -> tuple:
    return (r.index, r.ok, r.error, r.chunk_tokens, len(r.chunk_times), r.prompt_tokens, r.completion_tokens)


async def test_raw_records_equal_httpx_records(server: FakeServer) -> None:
    ep = Endpoint(f"http://127.0.0.1:{server.port}", model="m", api_key="k")
    kinds = [1, 2, 4, 1]
    raw = await _records(RawClient(ep.base_url), ep, kinds)
    want = await _records(HttpxClient(4), ep, kinds)
    assert [_seen(r) for r in raw] == [_seen(r) for r in want]
    ok, event_error, refused, again = raw
    assert (ok.ok, ok.chunk_tokens, ok.completion_tokens, ok.prompt_tokens) == (True, [1, 2, 1, 2], 5, 3)
    assert ok.start < ok.chunk_times[0] <= ok.chunk_times[-1] <= ok.end
    assert (event_error.ok, event_error.error, event_error.chunk_tokens) == (False, "worker died", [1, 2])
    assert not refused.ok and refused.error.startswith("HTTP 400: ") and "prompt too long" in refused.error
    assert again.ok
    assert server.bodies[0]["stream"] is True and server.bodies[0]["prompt"] == [1, 7, 7]


async def test_raw_keeps_one_connection_alive_across_requests(server: FakeServer) -> None:
    ep = Endpoint(f"http://127.0.0.1:{server.port}", model="m")
    recs = await _records(RawClient(ep.base_url), ep, [1, 4, 2, 1])
    assert [r.ok for r in recs] == [True, False, False, True]
    assert server.connections == 1


async def test_a_stream_cut_short_is_a_failed_record_and_the_next_request_reconnects(
    server: FakeServer,
) -> None:
    ep = Endpoint(f"http://127.0.0.1:{server.port}", model="m")
    cut, after = await _records(RawClient(ep.base_url), ep, [3, 1])
    assert not cut.ok and "closed the connection" in cut.error and cut.chunk_tokens == [1]
    assert after.ok and server.connections == 2
    httpx_cut, _ = await _records(HttpxClient(2), ep, [3, 1])
    assert not httpx_cut.ok and httpx_cut.chunk_tokens == [1]


async def test_nothing_listening_is_a_failed_record() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    (rec,) = await _records(RawClient(f"http://127.0.0.1:{port}"), Endpoint(f"http://127.0.0.1:{port}"), [1])
    assert not rec.ok and "ConnectionRefusedError" in rec.error


def test_sse_lines_split_at_any_byte_give_the_same_record() -> None:
    stream = (
        _event(_text("a")) + _event(_text("bc", 2)) + b": comment\n\n" + _event(USAGE) + b"data: [DONE]\n\n"
    )
    ticks = itertools.count(1)
    for cut in range(len(stream) + 1):
        rec = RequestRecord(index=0, start=0.0, prompt_tokens=9)
        sink = SseRecorder(rec, chat=False, clock=lambda: float(next(ticks)))
        sink.on_status(200)
        for part in (stream[:cut], stream[cut:]):
            sink.on_body(part)
        sink.finish()
        assert (rec.ok, rec.chunk_tokens, rec.prompt_tokens, rec.completion_tokens) == (True, [1, 2], 3, 5), (
            cut
        )


def test_raw_refuses_https_and_the_default_client_follows_the_scheme() -> None:
    with pytest.raises(ValueError, match="plain http"):
        RawClient("https://h:1")
    assert Clients().resolve("http://h:1") == "raw" and Clients().resolve("https://h") == "httpx"
    with pytest.raises(ValueError, match="--client httpx"):
        Clients("raw").resolve("https://h")
    with pytest.raises(ValueError, match="client-procs"):
        Clients(procs=0).resolve("http://h")
