"""Tracing and metrics through the real mesh (in this process, see inprocess.py): one request is one trace
with every hop linked parent to child, and every service's /metrics adds up after mixed traffic."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from prometheus_client.parser import text_string_to_metric_families

from libs.engine.tiny import write_tiny_model
from libs.telemetry.context import new_traceparent
from tests.e2e.inprocess import InProcessMesh

pytestmark = pytest.mark.e2e

DIRECT = 8  # prompts of at most this many tokens are prefilled on the decode worker
SERVICES = ("gateway", "scheduler", "kv-broker", "prefill-worker", "decode-worker")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def obs_mesh(tmp_path_factory: pytest.TempPathFactory):
    model = write_tiny_model(tmp_path_factory.mktemp("obs") / "tiny-v3", seed=0)
    mesh = InProcessMesh(model, direct_threshold=DIRECT).start()
    yield mesh
    mesh.stop()


def prompt_of(n: int, offset: int) -> list[int]:
    return [(offset + 13 * i) % 900 + 5 for i in range(n)]


def complete(mesh: InProcessMesh, prompt: list[int], max_tokens: int, headers: dict | None = None) -> dict:
    body = {
        "model": "tiny-v3",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def kv_bytes(mesh: InProcessMesh, prompt_tokens: int) -> int:
    """What moving one prompt's KV must write: every page it fills, in every layer."""
    pool = mesh.decode.engine.kv_pool
    return math.ceil(prompt_tokens / pool.page_size) * pool.bytes_per_page * pool.num_layers


def wait_for(cond: Callable[[], object], what: str, timeout: float = 20.0) -> object:
    deadline = time.monotonic() + timeout
    while not (result := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)  # polling a condition of another thread (spans end after the response)
    return result


# --- tracing ------------------------------------------------------------------------------------


def trace_of(mesh: InProcessMesh, request_id: str, want: set[str]) -> dict[str, list[ReadableSpan]]:
    """The spans of the trace holding `request_id`, by name, once every name in `want` has ended."""

    def spans() -> dict[str, list[ReadableSpan]] | None:
        done = mesh.exporter.get_finished_spans()
        mine = [s for s in done if s.attributes.get("moemesh.request_id") == request_id]
        if not mine:
            return None
        tid = mine[0].context.trace_id
        by_name: dict[str, list[ReadableSpan]] = {}
        for s in done:
            if s.context.trace_id == tid:
                by_name.setdefault(s.name, []).append(s)
        return by_name if want <= by_name.keys() else None

    return wait_for(spans, f"spans {sorted(want)} of {request_id}")  # type: ignore[return-value]


def service_of(s: ReadableSpan) -> str:
    return s.resource.attributes["service.name"]


def check_tree(by_name: dict[str, list[ReadableSpan]]) -> ReadableSpan:
    """One root, every other span's parent in the trace, children starting after their parents."""
    spans = [s for ss in by_name.values() for s in ss]
    ids = {s.context.span_id: s for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    assert len(roots) == 1, [s.name for s in roots]
    for s in spans:
        if s is not roots[0]:
            assert s.start_time >= ids[s.parent.span_id].start_time, s.name
    return roots[0]


def test_one_request_is_one_trace_through_every_hop(obs_mesh: InProcessMesh) -> None:
    client_tp = new_traceparent()  # the client's own trace context is the parent of the whole request
    r = complete(obs_mesh, prompt_of(40, 1), 6, headers={"traceparent": client_tp})
    hops = {"POST /v1/completions", "scheduler.place", "decode.reserve", "kv_broker.CreateHandle",
            "prefill", "kv_transfer", "decode"}  # fmt: skip
    t = trace_of(obs_mesh, f"{r['id']}-0", hops)
    one = {name: t[name][0] for name in hops}
    assert all(len(t[name]) == 1 for name in hops), {n: len(t[n]) for n in hops}
    gw, place, reserve, create = (one[n] for n in ("POST /v1/completions", "scheduler.place", "decode.reserve",
                                                    "kv_broker.CreateHandle"))  # fmt: skip
    prefill, transfer, decode = one["prefill"], one["kv_transfer"], one["decode"]

    assert (
        check_tree({n: t[n] for n in t if n not in ("kv_broker.HandleWritten", "kv_broker.HandleConsumed")})
        is gw
    )
    assert gw.context.trace_id == int(client_tp.split("-")[1], 16)
    assert gw.parent.span_id == int(client_tp.split("-")[2], 16)
    links = [
        (place, gw),
        (reserve, place),
        (create, reserve),
        (prefill, place),
        (transfer, prefill),
        (decode, prefill),
    ]
    for child, parent in links:
        assert child.parent.span_id == parent.context.span_id, (child.name, parent.name)
    want_service = {gw: "gateway", place: "scheduler", reserve: "decode-worker", create: "kv-broker",
                    prefill: "prefill-worker", transfer: "prefill-worker", decode: "decode-worker"}  # fmt: skip
    assert {s.name: service_of(s) for s in want_service} == {s.name: v for s, v in want_service.items()}

    assert gw.attributes["http.response.status_code"] == 200
    assert place.attributes["gen_ai.request.model"] == "tiny-v3"
    assert place.attributes["gen_ai.request.max_tokens"] == 6
    assert place.attributes["moemesh.placement"] == "disaggregated"
    assert place.attributes["moemesh.prefill_worker"] == "prefill-0"
    assert create.attributes["moemesh.kv.pages"] >= math.ceil(40 / obs_mesh.decode.engine.kv_pool.page_size)
    assert prefill.attributes["gen_ai.usage.input_tokens"] == 40
    assert transfer.attributes["moemesh.kv_transfer.bytes"] == kv_bytes(obs_mesh, 40)
    assert transfer.attributes["moemesh.kv_transfer.protocol"] == "tcp"
    assert (
        0
        < transfer.attributes["moemesh.kv_transfer.seconds"]
        <= (transfer.end_time - transfer.start_time) / 1e9
    )
    assert [e.name for e in decode.events] == ["first_token"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == r["usage"]["completion_tokens"] == 6
    assert decode.attributes["moemesh.finish_reason"] == "length"
    assert decode.end_time <= gw.end_time  # the HTTP response waited for the last token


def test_a_short_prompt_is_traced_straight_to_the_decode_worker(obs_mesh: InProcessMesh) -> None:
    r = complete(obs_mesh, prompt_of(DIRECT - 3, 2), 3)
    t = trace_of(obs_mesh, f"{r['id']}-0", {"POST /v1/completions", "scheduler.place", "decode"})
    assert "prefill" not in t and "kv_transfer" not in t
    gw, place, decode = t["POST /v1/completions"][0], t["scheduler.place"][0], t["decode"][0]
    assert check_tree(t) is gw and gw.parent is None  # no client context: the gateway starts the trace
    assert place.attributes["moemesh.placement"] == "direct"
    assert decode.parent.span_id == place.context.span_id and decode.attributes["moemesh.kind"] == "direct"


# --- metrics ------------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(mesh: InProcessMesh) -> dict[str, Samples]:
    out: dict[str, Samples] = {}
    for name in SERVICES:
        text = httpx.get(mesh.metrics_url(name), timeout=10).text
        out[name] = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def run_traffic(mesh: InProcessMesh) -> dict[str, list[int]]:
    """Mixed traffic; returns the prompt lengths and cached tokens the clients were told."""
    seen: dict[str, list[int]] = {"disaggregated": [], "cached": []}
    for prompt in (prompt_of(40, 3), prompt_of(40, 3), prompt_of(30, 4)):  # the repeat hits the prefix cache
        usage = complete(mesh, prompt, 5)["usage"]
        seen["disaggregated"].append(usage["prompt_tokens"])
        seen["cached"].append(usage["prompt_tokens_details"]["cached_tokens"])
    complete(mesh, prompt_of(DIRECT - 2, 5), 4)  # direct
    chat = {"model": "tiny-v3", "messages": [{"role": "user", "content": "hello there, how are you doing today? tell me a story"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{mesh.url}/v1/chat/completions", json=chat, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] > DIRECT
    seen["disaggregated"].append(usage["prompt_tokens"])
    seen["cached"].append(usage["prompt_tokens_details"]["cached_tokens"])
    long = {
        "model": "tiny-v3",
        "prompt": prompt_of(20, 6),
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=long, timeout=60) as r:
        # the first token comes from the prefill worker; the second from the decode worker's batch: from
        # then on the decode worker runs it, and the hang-up below is a cancel there
        data = (line for line in r.iter_lines() if line.startswith("data: {"))
        next(data), next(data)
    seen["disaggregated"].append(20)
    bad = httpx.post(f"{mesh.url}/v1/completions", json={"model": "tiny-v3", "prompt": "x", "temperature": 5})
    assert bad.status_code == 400
    mesh.wait_settled()
    return seen


@dataclass
class Traffic:
    """/metrics of every service before and after run_traffic(), and what the clients were told."""

    before: dict[str, Samples]
    after: dict[str, Samples]
    seen: dict[str, list[int]]

    def d(self, svc: str, name: str, **labels: str) -> float:
        return total(self.after[svc], name, **labels) - total(self.before[svc], name, **labels)


@pytest.fixture(scope="module")
def traffic(obs_mesh: InProcessMesh) -> Traffic:
    before = scrape(obs_mesh)
    seen = run_traffic(obs_mesh)

    def cancel_landed() -> dict[str, Samples] | None:
        after = scrape(obs_mesh)
        cancelled = total(
            after["decode-worker"], "moemesh_decode_requests_finished_total", reason="cancelled"
        )
        return (
            after
            if cancelled
            > total(before["decode-worker"], "moemesh_decode_requests_finished_total", reason="cancelled")
            else None
        )

    return Traffic(before, wait_for(cancel_landed, "the cancel to land"), seen)  # type: ignore[arg-type]


def test_gateway_requests_in_equal_requests_answered(traffic: Traffic) -> None:
    gw, d = traffic.after["gateway"], traffic.d
    assert total(gw, "moemesh_service_ready") == 1
    for endpoint in ("chat", "completions"):  # two counters, two code paths (TracedApp, the app)
        received = total(gw, "moemesh_gateway_requests_received_total", endpoint=endpoint)
        assert received == total(gw, "moemesh_gateway_requests_total", endpoint=endpoint) > 0
    assert d("gateway", "moemesh_gateway_requests_total", endpoint="completions", status="200") == 4
    assert d("gateway", "moemesh_gateway_requests_total", endpoint="completions", status="499") == 1
    assert d("gateway", "moemesh_gateway_requests_total", endpoint="completions", status="400") == 1
    assert d("gateway", "moemesh_gateway_requests_total", endpoint="chat", status="200") == 1
    assert d("gateway", "moemesh_gateway_e2e_request_latency_seconds_count") == 7
    assert total(gw, "moemesh_gateway_requests_in_flight") == 0


def test_scheduler_submits_equal_placed_refused_and_cancelled(traffic: Traffic) -> None:
    sc, d = traffic.after["scheduler"], traffic.d
    assert total(sc, "moemesh_service_ready") == 1
    outcomes = sum(
        total(sc, f"moemesh_scheduler_{n}_total") for n in ("placements", "refusals", "cancelled")
    )  # + queued and placing, none now
    assert total(sc, "moemesh_scheduler_requests_received_total") == outcomes
    assert total(sc, "moemesh_scheduler_queue_depth") == total(sc, "moemesh_scheduler_placing") == 0
    assert d("scheduler", "moemesh_scheduler_requests_received_total") == 6  # the 400 never left the gateway
    assert (
        d("scheduler", "moemesh_scheduler_placements_total", kind="disaggregated")
        == len(traffic.seen["disaggregated"])
        == 5
    )
    assert d("scheduler", "moemesh_scheduler_placements_total", kind="direct") == 1


def test_worker_requests_in_equal_requests_ended(traffic: Traffic) -> None:
    d, n_disagg = traffic.d, len(traffic.seen["disaggregated"])
    for role, svc in (("prefill", "prefill-worker"), ("decode", "decode-worker")):
        s = traffic.after[svc]
        assert total(s, "moemesh_service_ready") == 1
        received = total(s, f"moemesh_{role}_requests_received_total")
        assert received == total(s, f"moemesh_{role}_requests_finished_total") > 0
        assert total(s, f"moemesh_{role}_requests_running") == 0
    assert d("prefill-worker", "moemesh_prefill_requests_finished_total", reason="ok") == n_disagg
    assert d("decode-worker", "moemesh_decode_requests_received_total", kind="prefilled") == n_disagg
    assert d("decode-worker", "moemesh_decode_requests_received_total", kind="direct") == 1
    assert d("decode-worker", "moemesh_decode_requests_finished_total", reason="length") == 5
    assert d("decode-worker", "moemesh_decode_requests_finished_total", reason="cancelled") == 1


def test_kv_transfer_and_prefix_cache_metrics_match_the_requests(
    obs_mesh: InProcessMesh, traffic: Traffic
) -> None:
    d, seen = traffic.d, traffic.seen
    assert d("prefill-worker", "moemesh_kv_transfer_bytes_total") == sum(
        kv_bytes(obs_mesh, n) for n in seen["disaggregated"]
    )
    assert d("prefill-worker", "moemesh_kv_transfer_seconds_count") == len(seen["disaggregated"])
    hits = d("prefill-worker", "moemesh_prefill_prefix_cache_hits_total")
    assert hits == sum(seen["cached"]) > 0  # what the clients were told is what the cache found
    assert d("prefill-worker", "moemesh_prefill_prefix_cache_queries_total") == sum(seen["disaggregated"])
    assert 0 < total(traffic.after["prefill-worker"], "moemesh_prefill_prefix_cache_hit_rate") < 1
    for svc, worker in (("prefill-worker", obs_mesh.prefill), ("decode-worker", obs_mesh.decode)):
        pool = worker.engine.kv_pool
        kv = traffic.after[svc]
        assert total(kv, "moemesh_kv_pages_used") + total(kv, "moemesh_kv_pages_free") == pool.num_pages


def test_broker_did_the_bookkeeping_of_every_transfer(obs_mesh: InProcessMesh, traffic: Traffic) -> None:
    def ok(a: dict[str, Samples]) -> float:
        return total(a["kv-broker"], "moemesh_bus_messages_total", subscription="mesh.broker", outcome="ok")

    assert total(traffic.after["kv-broker"], "moemesh_service_ready") == 1
    # each disaggregated request: CreateHandle, HandleWritten, HandleConsumed (the last two in the background)
    want = 3 * len(traffic.seen["disaggregated"])
    wait_for(lambda: ok(scrape(obs_mesh)) - ok(traffic.before) >= want, "broker bookkeeping")
    assert total(scrape(obs_mesh)["kv-broker"], "moemesh_bus_messages_total", outcome="error") == 0


def test_dashboard_and_autoscalers_use_metrics_the_services_export(obs_mesh: InProcessMesh) -> None:
    import re

    import yaml

    exported = {  # metric families (labelled ones are listed before their first sample)
        fam.name
        for name in SERVICES
        for fam in text_string_to_metric_families(httpx.get(obs_mesh.metrics_url(name), timeout=10).text)
    }

    def base(n: str) -> str:  # a sample's family: histogram and counter suffixes dropped
        return re.sub(r"_(bucket|count|sum|total)$", "", n)

    dashboard = json.loads((ROOT / "deploy/grafana/moemesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {base(n) for e in exprs for n in re.findall(r"\b(moemesh_[a-z0-9_]+)", e)}
    assert len(used) > 20 and used <= exported, sorted(used - exported)
    hpa_metrics = {
        m["pods"]["metric"]["name"]
        for f in (ROOT / "deploy/k8s/base").glob("*.yaml")
        for doc in yaml.safe_load_all(f.read_text())
        if doc and doc.get("kind") == "HorizontalPodAutoscaler"
        for m in doc["spec"]["metrics"]
        if m["type"] == "Pods"
    }
    assert len(hpa_metrics) == 3 and hpa_metrics <= exported, sorted(hpa_metrics - exported)
