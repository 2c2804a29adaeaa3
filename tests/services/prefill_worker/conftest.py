"""A prefill worker service alone against a real nats-server: the test plays the kv-broker (a double that
answers registration and lookups and records HandleWritten) and the decode worker (a KV pool of the same
geometry registered with the in-process transport, or with Mooncake TCP when the rig asks for it, and
subscriptions on its inbox and the request's stream).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import torch

from libs.bus import Bus
from libs.engine import Engine
from libs.engine.tiny import write_tiny_model
from libs.kvtransfer import InProcessTransport, KvTransport, MooncakeTransport
from libs.worker.startup import geometry
from proto import messages as m
from proto import subjects
from services.prefill_worker.service import PrefillWorker, PrefillWorkerSettings
from tests.service_helpers import start_service, stop_service

DECODE = "decode-t"
GATEWAY_STREAM = subjects.stream("gw-t")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-v3", seed=0)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Engine:
    """The same checkpoint in this process: what the worker's first token and KV rows must equal."""
    return Engine.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def nats_url(private_nats_url: str) -> str:
    return private_nats_url


class DecodeSide:
    """The decode worker's pool (zeros until written) registered with its transport."""

    def __init__(self, like: torch.Tensor, page_size: int, transport: KvTransport) -> None:
        self.buffer = torch.zeros_like(like)  # [L, pages * page_size, row]
        self.page_size = page_size
        self.transport = transport
        self.transport.register(self.buffer.data_ptr(), self.buffer.numel() * self.buffer.element_size())

    def geometry(self, pool_geometry: m.KvGeometry) -> m.KvGeometry:
        """The prefill side's pool geometry, at this buffer's address (same model, same layout)."""
        return msgspec.structs.replace(pool_geometry, base_addr=self.buffer.data_ptr())

    def rows(self, page_ids: list[int], n: int) -> torch.Tensor:
        """The first n token rows (all layers) held in these pages, in order."""
        idx = torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in page_ids])[:n]
        return self.buffer[:, idx]


class Rig:
    """The worker under test, the broker double and the decode side's inbox and stream."""

    def __init__(self, bus: Bus, worker: PrefillWorker, decode: DecodeSide) -> None:
        self.bus, self.worker, self.decode = bus, worker, decode
        self.inbox: asyncio.Queue[msgspec.Struct] = asyncio.Queue()  # what reached the decode worker
        self.stream: asyncio.Queue[msgspec.Struct] = asyncio.Queue()  # what reached the gateway
        self.written: list[str] = []  # HandleWritten at the broker
        self.lookup_gate = asyncio.Event()  # LookupWorker answers only once set
        self.lookup_gate.set()

    async def on_broker(self, msg: m.BrokerRequest) -> m.BrokerReply:
        match msg:
            case m.LookupWorker():
                await self.lookup_gate.wait()
                geom = self.decode.geometry(geometry(self.worker.engine))
                rec = m.WorkerRecord(
                    worker_id=DECODE,
                    role=m.Role.DECODE,
                    session_id=self.decode.transport.session_id,
                    geometry=geom,
                )
                return m.BrokerReply(ok=True, worker=rec)
            case m.HandleWritten():
                self.written.append(msg.handle_id)
        return m.BrokerReply(ok=True)

    def task(self, prompt: list[int], page_ids: list[int], lease_ms: int = 30_000) -> m.PrefillTask:
        rid = uuid.uuid4().hex
        handle = m.KvHandle(
            handle_id=uuid.uuid4().hex, request_id=rid, decode_worker=DECODE,
            session_id=self.decode.transport.session_id, page_ids=page_ids, num_tokens=len(prompt),
            lease_expires_ms=int(time.time() * 1000) + lease_ms,
        )  # fmt: skip
        sampling = m.Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)
        return m.PrefillTask(
            request_id=rid, prompt_ids=prompt, sampling=sampling, stream_subject=GATEWAY_STREAM, handle=handle
        )

    def first_tokens(self) -> dict[str, list[int]]:
        """Take every first-token delta the gateway has received so far: request id -> [token, offset]."""
        out: dict[str, list[int]] = {}
        while not self.stream.empty():
            batch = self.stream.get_nowait()
            assert isinstance(batch, m.TokenBatch) and batch.worker_id == "", batch
            for d in batch.deltas:
                assert d.request_id not in out, f"{d.request_id}: first token streamed twice"
                out[d.request_id] = [*d.token_ids, d.offset]
        return out

    async def send(self, task: m.PrefillTask) -> None:
        await self.bus.publish(subjects.prefill_inbox(self.worker.instance_id), task)
        await self.bus.flush()

    async def next_inbox(self, timeout: float = 30.0) -> msgspec.Struct:
        async with asyncio.timeout(timeout):
            return await self.inbox.get()

    async def until(self, cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        """Wait for a condition of the worker under test (polled: it changes on the worker's own tasks)."""
        try:
            async with asyncio.timeout(timeout):
                while not cond():
                    await asyncio.sleep(0.01)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None

    async def settled(self) -> None:
        """The worker holds no task and no pinned page."""
        w = self.worker
        await self.until(
            lambda: not w.active and w.engine.stats()["pinned"] == 0, "no task and no pinned page"
        )


@pytest.fixture
async def make_rig(nats_url: str, model_dir: Path) -> AsyncIterator[Callable[..., object]]:
    started: list[tuple[PrefillWorker, asyncio.Task, Bus, DecodeSide]] = []

    async def make(lease_margin_ms: int = 1000, mooncake: bool = False, **more: object) -> Rig:
        """mooncake: both sides on Mooncake TCP over loopback (else the in-process transport)."""
        bus = await Bus.connect(nats_url, "prefill-test")
        settings = PrefillWorkerSettings(
            nats_url=nats_url, instance_id=f"prefill-{uuid.uuid4().hex[:8]}", model_dir=str(model_dir),
            transfer_protocol="tcp" if mooncake else "inprocess", lease_margin_ms=lease_margin_ms,
            heartbeat_interval_ms=60_000, broker_timeout_s=5.0, **more,
        )  # fmt: skip
        worker = PrefillWorker(settings)
        rig_box: list[Rig] = []

        async def on_broker(msg: m.BrokerRequest) -> m.BrokerReply:
            if isinstance(msg, m.RegisterWorker):  # the worker's pool, before the rig exists
                return m.BrokerReply(ok=True)
            return await rig_box[0].on_broker(msg)

        await bus.subscribe(subjects.BROKER, m.BrokerRequest, on_broker, concurrent=True)
        await bus.flush()
        task = await start_service(worker, timeout=120)
        transport = MooncakeTransport("tcp") if mooncake else InProcessTransport()
        decode = DecodeSide(worker.engine.kv_pool.buffer, worker.engine.page_size, transport)
        rig = Rig(bus, worker, decode)
        rig_box.append(rig)
        await bus.subscribe(subjects.decode_inbox(DECODE), m.DecodeInbox, rig.inbox.put)
        await bus.subscribe(GATEWAY_STREAM, m.StreamMessage, rig.stream.put)
        await bus.flush()
        started.append((worker, task, bus, decode))
        return rig

    yield make
    for worker, task, bus, decode in started:
        await stop_service(worker, task, timeout=30)
        await bus.close()
        decode.transport.close()
