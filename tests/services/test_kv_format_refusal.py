"""A prefill and a decode worker with different kv_cache_dtype do not form a mesh: the second to start fails its
setup with the kv-broker's reason (both workers and formats named), and the broker logs the refusal."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from libs.engine.tiny import write_tiny_model
from services.decode_worker.service import DecodeWorker, DecodeWorkerSettings
from services.kv_broker.service import BrokerSettings, KvBroker
from services.prefill_worker.service import PrefillWorker, PrefillWorkerSettings
from tests.service_helpers import start_service, stop_service


async def test_a_worker_with_the_other_kv_cache_dtype_refuses_to_start(
    nats_server: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tag = uuid.uuid4().hex[:8]
    model = str(write_tiny_model(tmp_path / "tiny", seed=1))
    broker = KvBroker(BrokerSettings(nats_url=nats_server, handles_bucket=f"h_{tag}", workers_bucket=f"w_{tag}"))
    broker_task = await start_service(broker)
    common = dict(nats_url=nats_server, model_dir=model, transfer_protocol="inprocess", warmup="off")
    prefill = PrefillWorker(PrefillWorkerSettings(instance_id=f"p-{tag}", kv_cache_dtype="fp8_e4m3", **common))
    prefill_task = await start_service(prefill, timeout=60)
    try:
        decode = DecodeWorker(DecodeWorkerSettings(instance_id=f"d-{tag}", **common))  # auto: float32 rows
        with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError) as info:
            await decode.run(install_signals=False)
        msg = str(info.value)
        assert f"kv-broker refused registration of d-{tag}" in msg and "KV cache format mismatch" in msg
        assert f"d-{tag} holds float32 pages" in msg and f"prefill worker p-{tag} holds fp8_e4m3" in msg
        assert f"refused registration of d-{tag}" in caplog.text  # the broker's own log line
    finally:
        await stop_service(prefill, prefill_task, timeout=30)
        await stop_service(broker, broker_task)
