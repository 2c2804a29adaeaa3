"""The broker refuses a worker whose KV format differs from a live worker of the other role (mixed
kv_cache_dtype between prefill and decode), with a logged reason; dead workers' records do not block."""

from __future__ import annotations

import asyncio
import logging
import uuid

import msgspec
import pytest

from libs.bus import Bus
from proto import messages as m
from proto import subjects
from services.kv_broker.service import FRESH_REGISTRATION_MS, KvBroker
from tests.service_helpers import start_service, stop_service

from .factories import geometry, register, worker
from .test_broker import FakeClock, settings


@pytest.fixture
async def broker(nats_server):
    clock = FakeClock(1_000_000)
    b = KvBroker(settings(nats_url=nats_server, tag=uuid.uuid4().hex[:12], max_sweep_interval_s=60.0), clock=clock)
    task = await start_service(b)
    yield b, clock
    await stop_service(b, task)


def _worker(wid: str, role: m.Role, dtype: str) -> m.WorkerRecord:
    rec = worker(wid)
    return msgspec.structs.replace(rec, role=role, geometry=msgspec.structs.replace(geometry(), dtype=dtype))


async def _register(client: Bus, w: m.WorkerRecord) -> m.BrokerReply:
    return await client.request(subjects.BROKER, register(w), m.BrokerReply, timeout=5)


async def test_mixed_kv_cache_dtypes_are_refused_clearly(broker, client, caplog):
    _, clock = broker
    assert (await _register(client, _worker("prefill-a", m.Role.PREFILL, "fp8_e4m3"))).ok
    with caplog.at_level(logging.ERROR, logger="moemesh.kv_broker"):
        reply = await _register(client, _worker("decode-a", m.Role.DECODE, "bfloat16"))
    assert not reply.ok
    assert "KV cache format mismatch: decode worker decode-a holds bfloat16 pages" in reply.message
    assert "prefill worker prefill-a holds fp8_e4m3" in reply.message and "kv_cache_dtype" in reply.message
    assert "refused registration of decode-a" in caplog.text
    lookup = await client.request(subjects.BROKER, m.LookupWorker(worker_id="decode-a"), m.BrokerReply, timeout=5)
    assert not lookup.ok  # never recorded
    assert (await _register(client, _worker("decode-b", m.Role.DECODE, "fp8_e4m3"))).ok  # the same format
    assert (await _register(client, _worker("prefill-b", m.Role.PREFILL, "fp8_e4m3"))).ok  # same role: no pages
    clock.now += FRESH_REGISTRATION_MS  # no heartbeat since: those workers are not live any more
    assert (await _register(client, _worker("decode-c", m.Role.DECODE, "bfloat16"))).ok


async def test_a_heartbeating_worker_keeps_blocking_past_the_registration_window(broker, client):
    b, clock = broker
    assert (await _register(client, _worker("decode-live", m.Role.DECODE, "bfloat16"))).ok
    beat = m.WorkerHeartbeat(
        worker_id="decode-live", role=m.Role.DECODE, model="tiny", running=0, waiting=0, free_pages=1,
        total_pages=1, page_size=16, max_context=64, interval_ms=60_000, sent_ms=0,
    )  # fmt: skip
    await client.publish(subjects.heartbeat("decode"), beat)
    deadline = asyncio.get_running_loop().time() + 5
    while not b.prefix.is_live("decode-live"):
        assert asyncio.get_running_loop().time() < deadline, "the broker never heard the heartbeat"
        await asyncio.sleep(0.01)
    clock.now += 2 * FRESH_REGISTRATION_MS
    reply = await _register(client, _worker("prefill-x", m.Role.PREFILL, "fp8_e4m3"))
    assert not reply.ok and "live decode worker decode-live holds bfloat16" in reply.message
    await client.publish(subjects.heartbeat("decode"), m.WorkerGone(worker_id="decode-live", role=m.Role.DECODE))
    while b.prefix.is_live("decode-live"):
        assert asyncio.get_running_loop().time() < deadline, "WorkerGone was not heard"
        await asyncio.sleep(0.01)
    assert (await _register(client, _worker("prefill-x", m.Role.PREFILL, "fp8_e4m3"))).ok
