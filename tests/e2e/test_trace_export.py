"""Tracing across real processes: the mesh as `moemesh up` runs it (every service its own process,
started by libs.launch with this process's environment), exporting over OTLP/HTTP to a collector this
test runs; one request must arrive as one trace whose spans come from five processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh, MeshConfig
from libs.telemetry.collector import Collector

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def traced_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, Collector]]:
    collector = Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    model = write_tiny_model(tmp_path_factory.mktemp("trace") / "tiny-v3", seed=0)
    cfg = MeshConfig(
        model_dir=model, port=0, log_dir=tmp_path_factory.mktemp("trace-logs"),
        extra_env={"services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "8"}},
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:  # the launcher's own environment, as for `moemesh up`
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s instead of 5 s
        mesh = Mesh(cfg).start()
    try:
        yield mesh, collector
    finally:
        mesh.stop()
        collector.shutdown()


def test_a_request_is_one_trace_across_five_processes(traced_mesh) -> None:
    mesh, collector = traced_mesh
    body = {"model": mesh.model_name, "prompt": list(range(5, 45)), "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    rid = f"{r.json()['id']}-0"
    want = {"POST /v1/completions", "scheduler.place", "decode.reserve", "kv_broker.CreateHandle", "prefill",
            "kv_transfer", "decode"}  # fmt: skip

    def trace() -> dict[str, tuple[str, object]] | None:
        with collector.lock:
            spans = list(collector.spans)
        tagged = [s for _, s in spans if any(a.key == "moemesh.request_id" and a.value.string_value == rid
                                             for a in s.attributes)]  # fmt: skip
        if not tagged:
            return None
        found = {s.name: (svc, s) for svc, s in spans if s.trace_id == tagged[0].trace_id}
        return found if want <= found.keys() else None

    deadline = time.monotonic() + 20
    while (found := trace()) is None:
        assert time.monotonic() < deadline, f"spans received: {sorted({s.name for _, s in collector.spans})}"
        time.sleep(0.05)  # the services export in the background every 0.1 s
    services = {svc for name, (svc, _) in found.items() if name in want}
    assert services == {"gateway", "scheduler", "kv-broker", "prefill-worker", "decode-worker"}
    span = {name: s for name, (_, s) in found.items()}
    with collector.lock:  # every span of the trace by name: under load a placement can be retried
        named: dict[str, list] = {}
        for _, s in collector.spans:
            if s.trace_id == span["POST /v1/completions"].trace_id:
                named.setdefault(s.name, []).append(s)
    for child, parent in [("scheduler.place", "POST /v1/completions"), ("decode.reserve", "scheduler.place"),
                          ("kv_broker.CreateHandle", "decode.reserve"), ("prefill", "scheduler.place"),
                          ("kv_transfer", "prefill"), ("decode", "prefill")]:  # fmt: skip
        parents = {p.span_id for p in named[parent]}
        assert all(c.parent_span_id in parents for c in named[child]), (child, parent)
    assert span["POST /v1/completions"].parent_span_id == b""  # the root
    nbytes = next(
        a.value.int_value for a in span["kv_transfer"].attributes if a.key == "moemesh.kv_transfer.bytes"
    )
    assert nbytes > 0
