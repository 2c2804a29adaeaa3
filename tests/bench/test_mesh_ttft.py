"""bench.mesh_ttft's clients: each prompt goes once per client, the clients' order alternating, and each
client's time is to its first text chunk (a small SSE server on a real socket stands in for the gateway)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import math
import threading
from collections.abc import AsyncIterator, Callable

import pytest

from bench.mesh_ttft import INTERLEAVED, STEP, StepSum, in_mesh_steps, mesh_ttft, own_share, ttft_row


@contextlib.asynccontextmanager
async def sse_server(on_request: Callable[[str], None]) -> AsyncIterator[str]:
    """A keep-alive HTTP server streaming one text chunk per request; `on_request` gets each request's
    client ("httpx" by its user agent, else "raw") before the answer is written. Yields its URL."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while True:  # keep-alive: requests one after another until the client closes
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                writer.close()
                return
            lines = head.decode().lower().split("\r\n")
            length = next(int(x.split(":")[1]) for x in lines if x.startswith("content-length:"))
            await reader.readexactly(length)
            on_request("httpx" if any(x.startswith("user-agent: python-httpx") for x in lines) else "raw")
            events = [b'data: {"choices":[{"text":"a"}]}\n\n', b"data: [DONE]\n\n"]
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
            writer.write(b"transfer-encoding: chunked\r\n\r\n" + chunks)
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for w in writers:
            w.close()
        server.close()
        await server.wait_closed()


async def test_each_prompt_is_sent_once_per_client_in_alternating_order() -> None:
    seen: list[str] = []
    between: list[list[int]] = []

    def engine(prompt: list[int]) -> float:
        between.append(prompt)
        seen.append("engine")
        return 0.5

    async with sse_server(seen.append) as url:
        got = await mesh_ttft(url, "m", [[1], [2], [3]], ["httpx", "raw"], engine)
    assert seen == ["httpx", "raw", "engine", "raw", "httpx", "engine", "httpx", "raw", "engine"]
    assert between == [[1], [2], [3]]
    assert got.pop(INTERLEAVED) == [0.5, 0.5, 0.5]
    assert {c: len(xs) for c, xs in got.items()} == {"httpx": 3, "raw": 3}
    assert all(x > 0 for xs in got.values() for x in xs)


async def test_each_requests_own_step_is_the_growth_of_the_step_sum_across_it() -> None:
    total = [0.25]  # seconds of step before the measured requests
    served: list[str] = []

    def step(client: str) -> None:  # the n-th request served is n ms of step
        served.append(client)
        total[0] += len(served) / 1e3

    async with sse_server(step) as url:
        got = await mesh_ttft(url, "m", [[1], [2]], ["httpx", "raw"], step_sum=lambda: total[0])
    assert served == ["httpx", "raw", "raw", "httpx"]
    assert got[STEP + "httpx"] == pytest.approx([1, 4]) and got[STEP + "raw"] == pytest.approx([2, 3])
    assert len(got["httpx"]) == len(got["raw"]) == 2


def test_the_own_share_is_each_requests_ttft_less_its_own_step() -> None:
    got = own_share([1.0, 2.0, 3.0], [5.0, 5.5, 9.0])
    assert (got["p50_ms"], got["mean_ms"], got["n"]) == (4.0, 4.5, 3)
    assert got["step"]["p50_ms"] == 2.0
    with pytest.raises(ValueError):
        own_share([1.0], [5.0, 6.0])


async def test_a_stream_without_a_token_is_an_error() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(x.split(b":")[1]) for x in head.lower().split(b"\r\n") if x.startswith(b"content-length")
        )
        await reader.readexactly(length)
        body = b'{"error":{"message":"no"}}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match="503"):
            await mesh_ttft(f"http://127.0.0.1:{port}", "m", [[1]], ["raw"])
    finally:
        server.close()
        await server.wait_closed()


def test_a_row_holds_the_first_clients_added_ttft_and_every_clients() -> None:
    def t(p50: float, p99: float) -> dict:
        return {"p50_ms": p50, "p99_ms": p99}

    row = ttft_row(5, "direct", t(2, 4), t(3, 6), {"httpx": t(9, 15), "raw": t(7, 12)})
    assert row["client"] == "httpx" and row["mesh"] == t(9, 15)
    assert (row["added_p50_ms"], row["added_p99_ms"], row["added_vs_idle_engine_p50_ms"]) == (7, 11, 6)
    assert row["by_client"]["raw"] == {
        "mesh": t(7, 12), "added_p50_ms": 5, "added_p99_ms": 8, "added_vs_idle_engine_p50_ms": 4
    }  # fmt: skip


def test_a_row_holds_the_mesh_against_the_interleaved_engine_and_the_paired_differences() -> None:
    def t(p50: float, p99: float) -> dict:
        return {"p50_ms": p50, "p99_ms": p99}

    paired = {"httpx": t(6.5, 10), "raw": t(4.5, 8)}
    row = ttft_row(5, "direct", t(2, 4), t(3, 6), {"httpx": t(9, 15), "raw": t(7, 12)}, t(2.5, 5), paired)
    assert row["engine_interleaved"] == t(2.5, 5)
    assert (
        row["added_vs_interleaved_engine_p50_ms"] == 6.5 and row["added_vs_interleaved_engine_p99_ms"] == 10
    )
    assert row["paired_added"] == t(6.5, 10)
    raw = row["by_client"]["raw"]
    assert (raw["added_vs_interleaved_engine_p50_ms"], raw["added_vs_interleaved_engine_p99_ms"]) == (4.5, 7)
    assert raw["paired_added"] == t(4.5, 8) and raw["added_p50_ms"] == 5


def test_the_in_mesh_step_is_the_histograms_mean_over_the_measured_requests() -> None:
    got = in_mesh_steps((1.0, 10.0), (1.5, 110.0), "decode-0", "moemesh_decode_step_seconds")
    assert got == {
        "worker": "decode-0",
        "metric": "moemesh_decode_step_seconds",
        "steps": 100.0,
        "mean_ms": 5.0,
    }
    assert math.isnan(in_mesh_steps((1.0, 10.0), (1.0, 10.0), "prefill-0", "m")["mean_ms"])


def test_the_step_sum_reads_its_one_series_from_the_filtered_metrics() -> None:
    pages = {"/metrics?name[]=moemesh_decode_step_seconds_sum": b"# TYPE x histogram\nmoemesh_decode_step_seconds_sum 0.25\n",
             "/labelled?name[]=moemesh_decode_step_seconds_sum": b'moemesh_decode_step_seconds_sum{a="1"} 1\n'
                                                                b'moemesh_decode_step_seconds_sum{a="2"} 2\n'}  # fmt: skip

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        read = StepSum(base + "/metrics", "moemesh_decode_step_seconds")
        assert read() == 0.25
        read.close()
        labelled = StepSum(base + "/labelled", "moemesh_decode_step_seconds")
        with pytest.raises(RuntimeError, match="expected one"):
            labelled()
        labelled.close()
    finally:
        server.shutdown()
        server.server_close()
