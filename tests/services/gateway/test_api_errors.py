"""Refusals, mesh failures, deadlines and disconnects, over raw HTTP (httpx) against a real nats-server.

Every test ends with the fixture's check that the gateway's in-flight table is empty.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import openai
import pytest

from services.gateway.service import Gateway
from tests.services.gateway.conftest import MAX_CONTEXT, MODEL, StartGateway, base_url
from tests.services.gateway.fake_mesh import FakeMesh

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


def error_of(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def post(url: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=10) as h:
        if isinstance(body, (bytes, str)):
            return await h.post(path, content=body, headers={"content-type": "application/json"}, **kw)
        return await h.post(path, json=body, **kw)


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


_COMP = {"model": MODEL, "prompt": "hello", "max_tokens": 5}
_TOOL = {"type": "function", "function": {"name": "f"}}
ODD_BODIES = [  # (path, body): each must get an answer below 500, whatever it is
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"-5": 1}}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1": 1e300}}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "notadict"}}}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}}),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "(((("}),
    ("/v1/chat/completions", {**CHAT, "guided_grammar": "root ::= ("}),
    ("/v1/chat/completions", {**CHAT, "guided_choice": []}),
    ("/v1/chat/completions", {**CHAT, "guided_json": "not json {"}),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "["}}),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}),
    ("/v1/chat/completions", {**CHAT, "stop": ["a"] * 17}),
    ("/v1/chat/completions", {**CHAT, "seed": -1}),
    ("/v1/chat/completions", {**CHAT, "messages": []}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "tool_calls": "x"}]}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}),
    ("/v1/chat/completions", {**CHAT, "tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
    ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "missing"}}}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**20}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": True}),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}),
    ("/v1/completions", {**_COMP, "prompt": [[1, 2], "x"]}),
    ("/v1/completions", {**_COMP, "prompt": [10**30]}),
    ("/v1/completions", {**_COMP, "prompt": ["", "a"]}),
    ("/v1/completions", {**_COMP, "stop_token_ids": [10**30]}),
    ("/v1/completions", {**_COMP, "top_k": 10**20}),
    ("/v1/completions", {**_COMP, "min_tokens": 10**20}),
    ("/v1/completions", {**_COMP, "best_of": 0}),
]  # fmt: skip


async def test_odd_bodies_get_no_server_error(url: str) -> None:
    answers = [(body, (await post(url, path, body)).status_code) for path, body in ODD_BODIES]
    assert [(body, status) for body, status in answers if status >= 500] == []


async def test_malformed_json_is_400(url: str) -> None:
    lone_surrogate = json.dumps({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}).encode()
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b'{"temperature": NaN}', lone_surrogate):
        r = await post(url, "/v1/chat/completions", body)
        assert r.status_code == 400, body
        assert error_of(r)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"temperature": 3}, "temperature"),
        ("/v1/chat/completions", {"top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"n": 17}, "n"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
        ("/v1/chat/completions", {"max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": MAX_CONTEXT}, "prompt"),
        # above int64, what the bus carries: these were 500s (an OverflowError encoding the Submit)
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "top_k": 2**64}, "top_k"),
    ],
)
async def test_bad_requests_are_400_naming_the_param(
    url: str, fake_mesh: FakeMesh, path: str, extra: dict, param: str
) -> None:
    body = {**CHAT, **extra}
    if path == "/v1/completions":
        body.pop("messages")
    r = await post(url, path, body)
    assert r.status_code == 400
    assert error_of(r)["param"] == param
    assert fake_mesh.submits == [], "nothing reaches the mesh"


async def test_context_length_and_unknown_model(url: str) -> None:
    r = await post(
        url,
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "word " * (2 * MAX_CONTEXT)}]},
    )
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    r = await post(url, "/v1/chat/completions", {**CHAT, "model": "gpt-4"})
    assert (
        r.status_code == 404
        and error_of(r)["code"] == "model_not_found"
        and "gpt-4" in error_of(r)["message"]
    )
    async with httpx.AsyncClient(base_url=url) as h:
        assert error_of(await h.get("/v1/nothing"))["type"] == "not_found_error"
        assert (await h.get("/v1/completions")).status_code == 405


async def test_body_size_limit(start_gateway: StartGateway, fake_mesh: FakeMesh) -> None:
    gw = await start_gateway(max_body_bytes=2048)
    r = await post(base_url(gw), "/v1/completions", {"model": MODEL, "prompt": "x" * 4000})
    assert r.status_code == 413 and "limit" in error_of(r)["message"]


async def test_api_key(start_gateway: StartGateway, fake_mesh: FakeMesh) -> None:
    gw = await start_gateway(api_key="sekret")
    url = base_url(gw)
    assert (await post(url, "/v1/chat/completions", CHAT)).status_code == 401
    r = await post(url, "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    assert (
        await post(url, "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer sekret"})
    ).status_code == 200
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
    assert [m.id for m in (await client.models.list()).data] == [MODEL]
    async with httpx.AsyncClient(base_url=url) as h:
        assert (await h.get("/v1/models")).status_code == 401
        assert (await h.get("/health")).status_code == 200  # probes need no key


@pytest.mark.parametrize(
    "code, message", [(429, "queue full (2 waiting)"), (503, "no decode worker is alive")]
)
async def test_scheduler_refusal_keeps_its_code(
    url: str, fake_mesh: FakeMesh, code: int, message: str
) -> None:
    fake_mesh.mode, fake_mesh.refuse = "refuse", (code, message)
    r = await post(url, "/v1/chat/completions", {**CHAT, "stream": True})
    assert r.status_code == code and error_of(r)["message"] == message


async def test_one_refused_choice_cancels_the_admitted_ones(url: str, fake_mesh: FakeMesh) -> None:
    fake_mesh.mode, fake_mesh.admit_first = "forever", 1
    r = await post(url, "/v1/chat/completions", {**CHAT, "n": 3, "max_tokens": 100})
    assert r.status_code == 429
    admitted = fake_mesh.submits[0].request_id
    assert (await fake_mesh.wait_cancel(admitted)).request_id == admitted


async def test_no_scheduler_is_503(start_gateway: StartGateway) -> None:
    gw = await start_gateway()
    r = await post(base_url(gw), "/v1/chat/completions", CHAT)
    assert r.status_code == 503 and "no scheduler" in error_of(r)["message"]


async def test_silent_scheduler_is_503_after_the_submit_timeout(
    start_gateway: StartGateway, fake_mesh: FakeMesh
) -> None:
    fake_mesh.mode = "silent"
    gw = await start_gateway(submit_timeout_s=0.3)
    r = await post(base_url(gw), "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert r.status_code == 503 and "within 0.3s" in error_of(r)["message"]
    await fake_mesh.wait_cancel(fake_mesh.submits[0].request_id)  # it may have been admitted after all


async def test_mesh_error_mid_stream_is_an_sse_error_then_done(url: str, fake_mesh: FakeMesh) -> None:
    fake_mesh.mode, fake_mesh.error_after = "error", 4
    r = await post(url, "/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 50})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["message"] == "decode worker d0 died" and err["type"] == "service_unavailable_error"
    content = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert "".join(c or "" for c in content), "tokens before the error were streamed"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], stream=True, max_tokens=50
    )
    with pytest.raises(openai.APIError, match="decode worker d0 died"):
        async for _ in stream:
            pass


async def test_mesh_error_non_streaming_keeps_its_code(url: str, fake_mesh: FakeMesh) -> None:
    fake_mesh.mode = "error"
    r = await post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 50, "n": 2})
    assert r.status_code == 503 and error_of(r)["message"] == "decode worker d0 died"


@pytest.mark.parametrize("stream", [False, True])
async def test_request_deadline_cancels_and_answers(
    start_gateway: StartGateway, fake_mesh: FakeMesh, stream: bool
) -> None:
    fake_mesh.mode = "forever"
    gw = await start_gateway(request_timeout_s=0.3)
    r = await post(base_url(gw), "/v1/chat/completions", {**CHAT, "max_tokens": 100, "stream": stream})
    if stream:
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
    else:
        assert r.status_code == 504 and "deadline" in error_of(r)["message"]
    assert (await fake_mesh.wait_cancel(fake_mesh.submits[0].request_id)).reason == "deadline"


async def test_streaming_client_disconnect_cancels(gateway: Gateway, fake_mesh: FakeMesh) -> None:
    fake_mesh.mode = "forever"
    async with (
        httpx.AsyncClient(base_url=base_url(gateway)) as h,
        h.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 100, "stream": True}) as r,
    ):
        lines = r.aiter_lines()
        content = 0
        while content < 2:
            line = await anext(lines)
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                content += 1
    (sub,) = fake_mesh.submits
    assert (await fake_mesh.wait_cancel(sub.request_id)).reason == "client disconnected"
    assert gateway.mesh is not None and gateway.mesh.in_flight == 0
    text = generate_metrics(gateway)
    assert 'moemesh_gateway_requests_total{endpoint="chat",status="499"} 1.0' in text


async def test_non_streaming_client_disconnect_cancels(gateway: Gateway, fake_mesh: FakeMesh) -> None:
    fake_mesh.mode = "forever"
    call = asyncio.create_task(
        post(base_url(gateway), "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100})
    )
    (sub,) = await fake_mesh.wait_submits(1)
    call.cancel()  # closes the connection mid-request
    with pytest.raises(asyncio.CancelledError):
        await call
    assert (await fake_mesh.wait_cancel(sub.request_id)).reason == "client disconnected"


def generate_metrics(gw: Gateway) -> str:
    from prometheus_client import generate_latest

    return generate_latest(gw.registry).decode()


async def test_table_is_empty_after_every_kind_of_ending(
    start_gateway: StartGateway, fake_mesh: FakeMesh
) -> None:
    # Every request here but the timed-out one ends well before its deadline; 2 s leaves room for a
    # scheduler's reply on a loaded 2-core CI machine (0.5 s did not: the refusal came back as a 503,
    # "no scheduler answered within 0.5s").
    gw = await start_gateway(request_timeout_s=2.0, max_migrations=0)
    url = base_url(gw)
    assert (await post(url, "/v1/chat/completions", CHAT)).status_code == 200  # normal
    fake_mesh.mode = "error"
    assert (await post(url, "/v1/chat/completions", {**CHAT, "max_tokens": 50})).status_code == 503  # failed
    fake_mesh.mode = "forever"
    assert (
        await post(url, "/v1/chat/completions", {**CHAT, "max_tokens": 100, "stop": "reads"})
    ).status_code == 200
    assert (
        await post(url, "/v1/chat/completions", {**CHAT, "max_tokens": 100})
    ).status_code == 504  # timed out
    fake_mesh.mode = "refuse"
    r = await post(url, "/v1/chat/completions", CHAT)
    assert r.status_code == 429, r.text  # refused
    assert gw.mesh is not None and gw.mesh.in_flight == 0


UNUSED = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low"}


async def test_unused_fields_are_ignored_with_one_log_line(
    url: str, fake_mesh: FakeMesh, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="moemesh.gateway"):
        r = await post(url, "/v1/chat/completions", {**CHAT, **UNUSED})
    assert r.status_code == 200
    lines = [m for m in caplog.messages if "ignored request fields" in m]
    assert lines == [
        "ignored request fields this server does not use: metadata, reasoning_effort, service_tier, store"
    ]


async def test_strict_fields_refuses_them(start_gateway: StartGateway, fake_mesh: FakeMesh) -> None:
    url = base_url(await start_gateway(strict_fields=True))
    r = await post(url, "/v1/chat/completions", {**CHAT, "store": True})
    assert r.status_code == 400 and error_of(r)["param"] == "store"
    assert "unrecognized request argument" in error_of(r)["message"] and not fake_mesh.submits
