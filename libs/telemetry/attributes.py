"""Span attributes from bus messages, named after OpenTelemetry's GenAI semantic conventions where one
fits (`gen_ai.request.*`, `gen_ai.usage.*`, `gen_ai.response.finish_reasons`) and `moemesh.*` otherwise.
Pure functions of proto messages, so every service names the same thing the same way."""

from __future__ import annotations

from typing import Any

from proto import messages as m

Attributes = dict[str, Any]


def sampling(s: m.Sampling) -> Attributes:
    a: Attributes = {
        "gen_ai.request.max_tokens": s.max_tokens,
        "gen_ai.request.temperature": s.temperature,
        "gen_ai.request.top_p": s.top_p,
    }
    if s.top_k > 0:
        a["gen_ai.request.top_k"] = s.top_k
    if s.seed is not None:
        a["gen_ai.request.seed"] = s.seed
    return a


def submit(s: m.Submit) -> Attributes:
    """The scheduler's view of a request: model, sampling, prompt length."""
    return {
        "moemesh.request_id": s.request_id,
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": s.model,
        "gen_ai.usage.input_tokens": len(s.prompt_ids),
        **sampling(s.sampling),
    }


def handle(h: m.KvHandle) -> Attributes:
    return {
        "moemesh.request_id": h.request_id,
        "moemesh.kv.handle_id": h.handle_id,
        "moemesh.kv.pages": len(h.page_ids),
        "moemesh.kv.tokens": h.num_tokens,
        "moemesh.decode_worker": h.decode_worker,
    }


def broker_request(req: Any) -> Attributes:
    """Whatever identifies a kv-broker request (handle, worker, request ids)."""
    match req:
        case m.CreateHandle(handle=h):
            return handle(h)
        case m.RegisterWorker(worker_id=wid, role=role):
            return {"moemesh.worker_id": wid, "moemesh.role": role.name.lower()}
        case m.LookupWorker(worker_id=wid):
            return {"moemesh.worker_id": wid}
        case m.ReleaseHandle(handle_id=hid, reason=reason):
            return {"moemesh.kv.handle_id": hid, "moemesh.reason": reason}
        case m.HandleWritten(handle_id=hid) | m.HandleConsumed(handle_id=hid) | m.LookupHandle(handle_id=hid):
            return {"moemesh.kv.handle_id": hid}
    return {}


def prefill_task(t: m.PrefillTask, model: str) -> Attributes:
    return {
        "gen_ai.request.model": model,
        "gen_ai.usage.input_tokens": len(t.prompt_ids),
        **handle(t.handle),
    }


def decode_start(prompt_ids: list[int], s: m.Sampling, model: str, cached_tokens: int = 0) -> Attributes:
    return {
        "gen_ai.request.model": model,
        "gen_ai.usage.input_tokens": len(prompt_ids),
        "moemesh.cached_tokens": cached_tokens,
        **sampling(s),
    }


def transfer(protocol: str, nbytes: int, seconds: float, runs: int, dst_worker: str) -> Attributes:
    """A KV transfer: what moved, how, and how fast."""
    return {
        "moemesh.kv_transfer.protocol": protocol,
        "moemesh.kv_transfer.bytes": nbytes,
        "moemesh.kv_transfer.seconds": seconds,
        "moemesh.kv_transfer.runs": runs,
        "moemesh.kv_transfer.gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        "moemesh.decode_worker": dst_worker,
    }
