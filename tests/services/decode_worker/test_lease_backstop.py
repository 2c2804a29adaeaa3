"""The decode worker's LeaseBackstop wired into the service, against a real nats-server: when the broker
never hears a reservation's CreateHandle (lost in a nats-server restart), nobody will ever send its
HandleExpired, and the worker itself frees the pages one lease length after the lease ended (not before:
a late Mooncake write may still land), tells the gateway the request must move, and releases the handle."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.engine.tiny import write_tiny_model
from proto import messages as m
from proto import subjects
from services.decode_worker.service import DecodeWorker, DecodeWorkerSettings
from tests.service_helpers import start_service, stop_service

LEASE_MS = 1500  # the backstop runs every second: a free at the lease's end (1.5 s) comes before 3 s
STREAM = subjects.stream("gw-backstop")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-v3", seed=0)


@pytest.fixture(scope="module")
def nats_url(private_nats_url: str) -> str:
    return private_nats_url


class LossyBroker:
    """Answers registration; CreateHandle is lost (never answered, as if the server restart ate it);
    records what else the worker tells it."""

    def __init__(self) -> None:
        self.creates: list[str] = []
        self.released: dict[str, str] = {}  # handle id -> reason

    async def on_request(self, msg: m.BrokerRequest) -> m.BrokerReply | None:
        match msg:
            case m.CreateHandle():
                self.creates.append(msg.handle.handle_id)
                return None  # lost: no reply, no record, so no HandleExpired will ever come
            case m.ReleaseHandle():
                self.released[msg.handle_id] = msg.reason
        return m.BrokerReply(ok=True)


@pytest.fixture
async def rig(nats_url: str, model_dir: Path) -> AsyncIterator[tuple[Bus, DecodeWorker, LossyBroker]]:
    bus = await Bus.connect(nats_url, "backstop-test")
    broker = LossyBroker()
    await bus.subscribe(subjects.BROKER, m.BrokerRequest, broker.on_request, concurrent=True)
    await bus.flush()
    settings = DecodeWorkerSettings(
        nats_url=nats_url, instance_id=f"decode-{uuid.uuid4().hex[:8]}", model_dir=str(model_dir),
        transfer_protocol="inprocess", heartbeat_interval_ms=60_000, broker_timeout_s=0.5, num_pages=64,
    )  # fmt: skip
    worker = DecodeWorker(settings)
    task = await start_service(worker, timeout=120)
    try:
        yield bus, worker, broker
    finally:
        await stop_service(worker, task, timeout=30)
        await bus.close()


async def reserve(bus: Bus, worker: DecodeWorker, rid: str, tokens: int) -> m.KvHandle:
    msg = m.ReserveKv(request_id=rid, num_tokens=tokens, lease_ms=LEASE_MS, stream_subject=STREAM)
    reply = await bus.request(subjects.decode_inbox(worker.instance_id), msg, m.ReserveKvReply, timeout=10)
    assert reply.ok and reply.handle is not None, reply
    return reply.handle


async def test_a_lost_create_handle_frees_the_reservation_one_lease_after_it_ended(rig) -> None:
    bus, worker, broker = rig
    errors: asyncio.Queue[m.RequestError] = asyncio.Queue()

    async def on_stream(msg: m.StreamMessage) -> None:
        if isinstance(msg, m.RequestError):
            errors.put_nowait(msg)

    await bus.subscribe(STREAM, m.StreamMessage, on_stream)
    await bus.flush()
    free_before = worker.engine.stats()["free_pages"]
    t0 = time.monotonic()
    lost = await reserve(bus, worker, "r-lost", 40)
    answered = await reserve(bus, worker, "r-answered", 20)
    assert worker.engine.stats()["free_pages"] == free_before - len(lost.page_ids) - len(answered.page_ids)
    assert worker.load()["pending"] == 2  # the heartbeat counts each as a batch slot taken soon
    # The other reservation ends the normal way: its prefill worker gives up.
    failed = m.PrefillFailed(request_id="r-answered", handle_id=answered.handle_id, message="no capacity")
    await bus.publish(subjects.decode_inbox(worker.instance_id), failed)
    await bus.flush()

    async with asyncio.timeout(10 + 3 * LEASE_MS / 1000):
        err = await errors.get()  # the backstop's end of the lost reservation
        freed_after = time.monotonic() - t0
        while worker.reserved or worker.engine.stats()["free_pages"] != free_before:
            await asyncio.sleep(0.01)  # the pages come back on the engine thread right after
    assert (err.request_id, err.code) == ("r-lost", 503) and "lease" in err.message
    assert freed_after >= 2 * LEASE_MS / 1000  # not before one more lease length past the lease's end
    assert lost.handle_id in broker.creates and answered.handle_id in broker.creates  # both sent, both lost
    async with asyncio.timeout(10):  # the broker is told too, once the lost CreateHandle timed out
        while not {lost.handle_id, answered.handle_id} <= set(broker.released):
            await asyncio.sleep(0.01)
    assert broker.released[lost.handle_id] == "lease expired"
    assert broker.released[answered.handle_id].startswith("prefill failed")
    assert errors.empty()  # the answered reservation was not the gateway's business
    assert len(worker.leases) == 0 and worker.worker_stats().reserved_handles == 0
    assert worker.load()["pending"] == 0
