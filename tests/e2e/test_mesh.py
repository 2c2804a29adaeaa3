"""End to end through the real mesh: the official openai client against the gateway, nats-server, the
scheduler, kv-broker, a prefill and a decode worker with Mooncake TCP between them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import nats
import openai
import pytest

from libs.chaos import metric_total, stream_many
from libs.chaos.load import Progress
from libs.engine import Engine, SamplingParams
from libs.launch.mesh import Mesh
from libs.tokenizer import Tokenizer
from proto import decoder, encode, subjects
from proto import messages as m
from tests.e2e import listening
from tests.e2e.conftest import DIRECT_THRESHOLD

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    return Engine.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model)


@pytest.fixture
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="none", max_retries=0, timeout=60)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 1000 + 3 for i in range(n)]


def in_process(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


IDS = {"logprobs": 0, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}


def ids_of(tokens: list[str] | None) -> list[int]:
    """Token ids from logprobs that name tokens "token_id:<id>" (return_tokens_as_token_ids)."""
    assert tokens is not None
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def mesh_tokens(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """Greedy completion through the mesh: the token ids the decode side produced, and the text."""
    r = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens, temperature=0, **IDS
    )
    assert r.usage is not None and r.usage.completion_tokens == max_tokens
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].logprobs is not None
    return ids_of(r.choices[0].logprobs.tokens), r.choices[0].text


@pytest.mark.parametrize("plen", [DIRECT_THRESHOLD - 3, 40, 90], ids=["direct", "disagg-40", "disagg-90"])
def test_greedy_through_mesh_equals_in_process_engine(client, engine, tok, plen: int) -> None:
    prompt = prompt_of(plen, plen)
    want = in_process(engine, [prompt], 24)[0]
    ids, text = mesh_tokens(client, prompt, 24)
    assert ids == want
    assert text == tok.decode(want)


def test_disaggregated_request_moved_kv_over_mooncake(mesh: Mesh, client, engine) -> None:
    before = metric_total(mesh.metrics_url("prefill-0"), "moemesh_kv_transfer_bytes_total")
    prompt = prompt_of(64, 5)
    assert mesh_tokens(client, prompt, 8)[0] == in_process(engine, [prompt], 8)[0]
    assert metric_total(mesh.metrics_url("prefill-0"), "moemesh_kv_transfer_bytes_total") > before


def test_chat_streaming_with_openai_client(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there, how are you today?"}],
        max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    full = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there, how are you today?"}],
        max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert full.choices[0].message.content == text


def test_32_concurrent_streams_each_equal_the_engine(mesh: Mesh, engine) -> None:
    """Every one of 32 concurrent streams (both PD paths, mixed lengths) gets the engine's greedy token ids."""
    prompts = [prompt_of(4 + (i * 5) % 50, i) for i in range(32)]
    lengths = [10 + i % 7 for i in range(32)]
    longest = in_process(engine, prompts, max(lengths))  # greedy, ignore_eos: shorter runs are prefixes
    want = [ids[:n] for ids, n in zip(longest, lengths, strict=True)]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[list[int], str | None]:
        stream = await client.completions.create(
            model=mesh.model_name, prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True, **IDS
        )
        ids: list[int] = []
        finish = None
        async for c in stream:
            if c.choices:
                ids += ids_of(c.choices[0].logprobs.tokens) if c.choices[0].logprobs else []
                finish = c.choices[0].finish_reason or finish
        return ids, finish

    async def main() -> list[tuple[list[int], str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert [finish for _, finish in results] == ["length"] * 32
    wrong = [i for i, (ids, _) in enumerate(results) if ids != want[i]]
    assert not wrong, f"streams {wrong} differ from the engine: {[(results[i][0], want[i]) for i in wrong]}"


async def _admin_stats(mesh: Mesh, service: str, worker: str) -> m.AdminReply:
    nc = await nats.connect(mesh.nats_url)
    try:
        r = await nc.request(subjects.admin(service, worker), encode(m.GetStats()), timeout=5)
        return decoder(m.AdminReply).decode(r.data)
    finally:
        await nc.close()


def _wait_for(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_client_disconnect_frees_pages_on_both_workers(mesh: Mesh) -> None:
    def stats() -> tuple[m.WorkerStats, m.WorkerStats]:
        d = asyncio.run(_admin_stats(mesh, "decode-worker", "decode-0")).stats
        p = asyncio.run(_admin_stats(mesh, "prefill-worker", "prefill-0")).stats
        assert d is not None and p is not None
        return d, p

    _wait_for(lambda: stats()[0].running == 0, "an idle decode worker")
    body = {
        "model": mesh.model_name,
        "prompt": prompt_of(60, 3),
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{mesh.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        d, _ = stats()
        assert d.running == 1 and len(d.requests) == 1
    # the stream is closed: the gateway cancels through the mesh, both workers drop the request
    _wait_for(
        lambda: stats()[0].running == 0 and not stats()[0].requests, "the decode worker to drop the request"
    )
    d, p = stats()
    assert d.reserved_handles == 0 and p.reserved_handles == 0 and p.running == 0


def test_bad_input_gets_openai_errors(mesh: Mesh) -> None:
    url = f"{mesh.url}/v1/completions"
    with httpx.Client(timeout=30) as h:
        r = h.post(url, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
        r = h.post(url, json={"model": "no-such-model", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = h.post(url, json={"model": mesh.model_name, "prompt": [5] * 5000, "max_tokens": 4})
        assert r.status_code == 400
        for bad in ({"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}):
            r = h.post(url, json={"model": mesh.model_name, "prompt": "hi", **bad})
            assert r.status_code == 400, bad
            assert r.json()["error"]["param"] == next(iter(bad))


def test_garbage_on_the_bus_is_rejected_and_services_keep_serving(mesh: Mesh, client, engine, tok) -> None:
    async def send_garbage() -> None:
        nc = await nats.connect(mesh.nats_url)
        try:
            for subject in (
                subjects.SCHED_SUBMIT,
                subjects.decode_inbox("decode-0"),
                subjects.prefill_inbox("prefill-0"),
                subjects.BROKER,
            ):
                r = (
                    await nc.request(subject, b"\x93garbage", timeout=5)
                    if subject in (subjects.SCHED_SUBMIT, subjects.BROKER)
                    else None
                )
                if r is not None:
                    rej = decoder(m.Rejected).decode(r.data)
                    assert rej.code == 400
                else:
                    await nc.publish(subject, b"\x93garbage")
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(send_garbage())
    prompt = prompt_of(30, 11)
    assert mesh_tokens(client, prompt, 6)[0] == in_process(engine, [prompt], 6)[0]
    for name in ("decode-0", "prefill-0"):
        log = mesh.log_dir / f"{name}.log"
        _wait_for(
            lambda log=log: "undecodable message on mesh." in log.read_text(), f"{name}'s rejection log line"
        )


async def _list_handles(mesh: Mesh) -> dict[str, m.HandleState]:
    nc = await nats.connect(mesh.nats_url)
    try:
        r = await nc.request(subjects.BROKER, encode(m.ListHandles()), timeout=10)
        reply = decoder(m.BrokerReply).decode(r.data)
        assert reply.ok, reply.message
        return {h.handle.handle_id: h.state for h in reply.handles}
    finally:
        await nc.close()


def _broker_answers(mesh: Mesh) -> bool:
    try:
        asyncio.run(_list_handles(mesh))
        return True
    except Exception:
        return False


def test_broker_restart_mid_traffic_loses_no_handle(mesh: Mesh, client, engine, tok) -> None:
    for i in range(4):  # disaggregated requests leave handle records at the broker
        mesh_tokens(client, prompt_of(30 + i, 100 + i), 2)
    _wait_for(lambda: len(asyncio.run(_list_handles(mesh))) >= 4, "4 handle records at the broker")
    before = asyncio.run(_list_handles(mesh))

    prompts = [prompt_of(20 + 3 * i, 200 + i) for i in range(12)]
    want = [tok.decode(t) for t in in_process(engine, prompts, 40)]

    async def restart(progress: Progress) -> None:  # a crash: the launcher's supervisor restarts it
        assert await progress.wait(1, 1, timeout=120), "no request streamed before the broker restart"
        n = mesh.sup.restarts("kv-broker")
        await asyncio.to_thread(mesh.sup.kill, "kv-broker")
        await asyncio.to_thread(mesh.wait_restarted, "kv-broker", n + 1)

    outcomes = asyncio.run(stream_many(mesh.url, mesh.model_name, prompts, 40, deadline_s=120, fault=restart))
    assert [o.text for o in outcomes] == want, [o.error for o in outcomes]
    _wait_for(lambda: _broker_answers(mesh), "the restarted broker to answer")
    after = asyncio.run(_list_handles(mesh))
    lost = {h: s for h, s in before.items() if h not in after}
    assert not lost, f"handles lost across the broker restart: {lost}"
    assert all(after[h] == s for h, s in before.items())


async def _sessions(mesh: Mesh) -> dict[str, str]:
    """Each worker's Mooncake session ("host:rpc_port") as it registered it at the kv-broker."""
    nc = await nats.connect(mesh.nats_url)
    try:
        out = {}
        for w in mesh.worker_ids(m.Role.PREFILL) + mesh.worker_ids(m.Role.DECODE):
            r = await nc.request(subjects.BROKER, encode(m.LookupWorker(worker_id=w)), timeout=10)
            reply = decoder(m.BrokerReply).decode(r.data)
            assert reply.ok and reply.worker is not None, reply.message
            out[w] = reply.worker.session_id
        return out
    finally:
        await nc.close()


def test_every_listening_socket_binds_the_mesh_address_but_mooncakes_two(mesh: Mesh) -> None:
    """On loopback nothing the mesh opens listens on a wildcard, save the named exception: Mooncake's
    transfer engine (mooncake-transfer-engine 0.3.x) binds its P2P handshake port on 0.0.0.0 and its
    TcpTransport data port on [::] (dual stack) whatever address it is given (docs/operations.md#security)."""
    sessions = asyncio.run(_sessions(mesh))
    for name, proc in mesh.sup.procs.items():
        pids = listening.group_pids(proc.proc.pid)
        socks = listening.listening(pids)
        assert socks, f"{name} listens on nothing we can see"
        wild = [s for s in socks if s.wildcard]
        if name in sessions:
            host, rpc_port = sessions[name].rsplit(":", 1)
            assert host == mesh.cfg.host, sessions[name]  # the session names the configured address
            handshake = [s for s in wild if (s.proto, s.address, s.port) == ("tcp", "0.0.0.0", int(rpc_port))]
            data = [s for s in wild if (s.proto, s.address) == ("tcp6", "::") and s.port != int(rpc_port)]
            assert len(handshake) == 1 and len(data) == 1, f"{name}: Mooncake's listeners changed: {wild}"
            wild = [s for s in wild if s not in handshake + data]
        assert not wild, f"{name} listens on a wildcard address: {wild}"
        assert {s.address for s in socks if not s.wildcard} == {mesh.cfg.host}, (name, socks)
