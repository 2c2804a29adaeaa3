"""Gateway test fixtures: a checkpoint folder without weights (tokenizer + config.json), a running
gateway on a real nats-server, and the scheduler/worker double."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.tokenizer import Tokenizer
from libs.tokenizer.build import build_tokenizer
from services.gateway.service import Gateway
from services.gateway.settings import GatewaySettings
from tests.services.gateway.fake_mesh import FakeMesh

MAX_CONTEXT = 1024
MODEL = "tiny-test"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gateway reads only config.json and the tokenizer files, so no weights are written."""
    d = build_tokenizer(tmp_path_factory.mktemp("gateway-model"))
    vocab = Tokenizer.from_pretrained(d).vocab_size
    config = {"model_type": "deepseek_v3", "max_position_embeddings": MAX_CONTEXT, "vocab_size": vocab}
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


StartGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def start_gateway(nats_server: str, model_dir: Path) -> AsyncIterator[StartGateway]:
    """Start gateways in this event loop (port 0); on teardown, check none leaked a request, then stop."""
    started: list[tuple[Gateway, asyncio.Task]] = []

    async def start(**overrides: object) -> Gateway:
        fields = dict(
            nats_url=nats_server, model_dir=str(model_dir), port=0, served_model_name=MODEL,
            instance_id=f"gw-{uuid.uuid4().hex[:8]}", drain_timeout_s=2.0,
        )  # fmt: skip
        fields.update(overrides)
        gw = Gateway(GatewaySettings(**fields))  # type: ignore[arg-type]
        task = asyncio.create_task(gw.run(install_signals=False))
        started_wait = asyncio.create_task(gw.started.wait())
        await asyncio.wait({task, started_wait}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        if not gw.started.is_set():
            started_wait.cancel()
            await task  # raises the setup error
            raise RuntimeError("gateway did not start")
        started.append((gw, task))
        return gw

    yield start
    for gw, task in started:
        assert gw.mesh is not None and gw.mesh.in_flight == 0, "a request leaked in the gateway's table"
        gw.request_stop()
        await asyncio.wait_for(task, 10)


@pytest.fixture
async def fake_mesh(nats_server: str, tokenizer: Tokenizer) -> AsyncIterator[FakeMesh]:
    bus = await Bus.connect(nats_server, "fake-mesh")
    mesh = FakeMesh(bus, tokenizer)
    await mesh.start()
    yield mesh
    await mesh.stop()
    await bus.close()


@pytest.fixture
async def gateway(start_gateway: StartGateway, fake_mesh: FakeMesh) -> Gateway:
    return await start_gateway()


def base_url(gw: Gateway) -> str:
    return f"http://127.0.0.1:{gw.port}"


@pytest.fixture
def url(gateway: Gateway) -> Iterator[str]:
    yield base_url(gateway)
