"""The gateway's SSE response as an ASGI app, message by message: the last event closes the response in
its own body message (no empty one after it), a client's disconnect while the stream waits for tokens ends
it quietly as 499 with the generation closed, and a cancellation that is not the client's propagates."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.gateway import formatting as fmt
from services.gateway.app import CLIENT_GONE, _SSEResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "headers": []}
EVENT = b'data: {"choices":[{"text":"a"}]}\n\n'


class Gen:
    def __init__(self) -> None:
        self.closed: list[str] = []

    def close(self, reason: str) -> None:
        self.closed.append(reason)


class Client:
    """ASGI receive/send of one HTTP exchange: what was sent, and a disconnect to trigger."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.away = asyncio.Event()

    async def receive(self) -> dict:
        await self.away.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def response(events: AsyncIterator[bytes]) -> tuple[_SSEResponse, Gen, list[int]]:
    gen, statuses = Gen(), []
    return _SSEResponse(events, gen, statuses.append), gen, statuses  # type: ignore[arg-type]


async def test_the_last_event_closes_the_response_in_the_same_message():
    async def events():
        yield EVENT
        yield EVENT + fmt.SSE_DONE

    resp, gen, statuses = response(events())
    client = Client()
    await resp(SCOPE, client.receive, client.send)
    assert [m["type"] for m in client.sent] == [
        "http.response.start",
        "http.response.body",
        "http.response.body",
    ]
    assert client.sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in client.sent[0]["headers"]
    assert [(m["body"], m["more_body"]) for m in client.sent[1:]] == [
        (EVENT, True),
        (EVENT + fmt.SSE_DONE, False),
    ]
    assert gen.closed and statuses == [CLIENT_GONE]  # the events generator counted its own status before


async def test_events_that_end_without_done_still_end_the_response():
    async def events():
        yield EVENT

    resp, _, _ = response(events())
    client = Client()
    await resp(SCOPE, client.receive, client.send)
    assert [(m["body"], m["more_body"]) for m in client.sent[1:]] == [(EVENT, True), (b"", False)]


async def test_a_disconnect_while_waiting_for_tokens_ends_the_stream_as_499():
    waiting, closed = asyncio.Event(), asyncio.Event()

    async def events():
        try:
            yield EVENT
            waiting.set()
            await asyncio.Event().wait()  # the next token never comes
            yield EVENT + fmt.SSE_DONE
        finally:
            closed.set()

    resp, gen, statuses = response(events())
    client = Client()
    call = asyncio.ensure_future(resp(SCOPE, client.receive, client.send))
    await waiting.wait()
    client.away.set()
    await asyncio.wait_for(call, 5)  # returns: the cancellation was the client's, and is not raised
    assert closed.is_set() and gen.closed == ["client disconnected"] and statuses == [CLIENT_GONE]
    assert [m.get("more_body") for m in client.sent[1:]] == [True]  # nothing after the disconnect
    assert call.cancelling() == 0  # type: ignore[attr-defined]  # uncancelled: the task serves on


async def test_a_cancellation_that_is_not_the_clients_propagates():
    waiting = asyncio.Event()

    async def events():
        yield EVENT
        waiting.set()
        await asyncio.Event().wait()
        yield fmt.SSE_DONE

    resp, gen, statuses = response(events())
    client = Client()
    call = asyncio.ensure_future(resp(SCOPE, client.receive, client.send))
    await waiting.wait()
    call.cancel()  # e.g. the server shutting down
    with pytest.raises(asyncio.CancelledError):
        await call
    assert gen.closed and statuses == [CLIENT_GONE]
