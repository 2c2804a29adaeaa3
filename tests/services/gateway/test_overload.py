"""Overload at the gateway: the scheduler's 429 (queue full) and 503 reach the client with Retry-After,
and the gateway bounds the mesh requests it holds itself (429 past max_in_flight), so memory does not
grow with the offered load."""

from __future__ import annotations

import asyncio

import httpx

from tests.services.gateway.conftest import MODEL, StartGateway, base_url
from tests.services.gateway.fake_mesh import FakeMesh
from tests.services.gateway.test_api_errors import post

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 5}


async def test_queue_full_is_429_with_retry_after(start_gateway: StartGateway, fake_mesh: FakeMesh) -> None:
    fake_mesh.mode, fake_mesh.refuse = "refuse", (429, "queue full (1024 requests)")
    gw = await start_gateway(retry_after_s=3)
    for stream in (False, True):
        r = await post(base_url(gw), "/v1/completions", {**BODY, "stream": stream})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "rate_limit_error"
    fake_mesh.refuse = (503, "no live decode worker")
    r = await post(base_url(gw), "/v1/completions", BODY)
    assert r.status_code == 503 and r.headers["retry-after"] == "3"


async def test_gateway_bounds_requests_in_flight(start_gateway: StartGateway, fake_mesh: FakeMesh) -> None:
    fake_mesh.mode = "forever"
    gw = await start_gateway(max_in_flight=2)
    url = base_url(gw)
    async with httpx.AsyncClient(base_url=url, timeout=10) as h:
        body = {**BODY, "max_tokens": 100, "stream": True}
        async with (
            h.stream("POST", "/v1/completions", json=body) as a,
            h.stream("POST", "/v1/completions", json=body) as b,
        ):
            assert a.status_code == b.status_code == 200
            r = await h.post("/v1/completions", json=BODY)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
            assert len(fake_mesh.submits) == 2  # the third never reached the mesh
    # the two streams are closed: room again
    fake_mesh.mode = "tokens"
    async with asyncio.timeout(10):
        while gw.mesh is not None and gw.mesh.in_flight:
            await asyncio.sleep(0.01)  # the disconnects are being cleaned up by the server task
    assert (await post(url, "/v1/completions", BODY)).status_code == 200
