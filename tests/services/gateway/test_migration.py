"""Request migration at the gateway: a choice whose worker dies (silence, a retryable RequestError, or a
lost delta) is re-submitted as prompt + tokens so far and the client's stream continues without a
repeated or skipped token; up to max_migrations, then an error event. Pure ChoiceRun rules first, then
the gateway against a real nats-server and a scripted double whose 'model' output is a fixed script."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest

from libs.bus import Bus
from libs.tokenizer import Tokenizer
from proto import subjects
from proto.messages import (
    Cancel,
    FinishReason,
    RequestError,
    Role,
    Sampling,
    Submit,
    SubmitReply,
    TokenBatch,
    TokenDelta,
    WorkerHeartbeat,
)
from services.gateway.migration import ChoiceRun, TokenGap
from tests.services.gateway.conftest import MODEL, StartGateway, base_url
from tests.services.gateway.fake_mesh import TEXT
from tests.services.gateway.test_api_errors import post, sse_events

# --- pure rules ---------------------------------------------------------------------------------


def run_of(max_tokens: int = 10, max_migrations: int = 2) -> ChoiceRun:
    return ChoiceRun("cmpl-1-0", [1, 2, 3], Sampling(max_tokens=max_tokens, temperature=0.0), max_migrations)


def test_accept_trims_repeats_and_detects_gaps() -> None:
    run = run_of()
    assert run.accept(TokenDelta("cmpl-1-0", [7, 8], offset=0)).token_ids == [7, 8]
    trimmed = run.accept(TokenDelta("cmpl-1-0", [8, 9], offset=1))
    assert trimmed is not None and trimmed.token_ids == [9] and trimmed.offset == 2
    assert run.accept(TokenDelta("cmpl-1-0", [9], offset=2)) is None  # a pure repeat
    with pytest.raises(TokenGap):
        run.accept(TokenDelta("cmpl-1-0", [11], offset=4))
    assert run.accept(TokenDelta("cmpl-1-0", [10])).token_ids == [10]  # no offset: taken as is
    assert run.tokens == [7, 8, 9, 10]


def test_next_submit_carries_prompt_plus_tokens_and_the_rest_of_max_tokens() -> None:
    run = run_of(max_tokens=10)
    run.accept(TokenDelta("cmpl-1-0", [7, 8, 9], offset=0))
    assert run.can_migrate(503) and not run.can_migrate(400) and not run.can_migrate(504)
    sub = run.next_submit(MODEL, "mesh.stream.g", 5, lost="decode-1")
    assert sub.request_id == run.rid == "cmpl-1-0-m1"
    assert sub.prompt_ids == [1, 2, 3, 7, 8, 9] and sub.sampling.max_tokens == 7 and sub.avoid == ["decode-1"]
    assert sub.sampling.temperature == 0.0
    # offsets restart with the new attempt; usage never counts generated tokens as cached prompt
    d = run.accept(TokenDelta(sub.request_id, [4], offset=0, cached_tokens=6))
    assert d is not None and d.cached_tokens == 3 and run.tokens == [7, 8, 9, 4]
    again = run.renew(sub)
    assert again.request_id == run.rid != sub.request_id and again.prompt_ids == sub.prompt_ids
    run.next_submit(MODEL, "s", 6, lost="decode-0")
    assert run.migrations == 2 and not run.can_migrate(503)
    with pytest.raises(ValueError, match="max_migrations"):
        ChoiceRun("x", [1], Sampling(), -1)


# --- through the gateway --------------------------------------------------------------------------


@dataclass
class ScriptedMesh:
    """Answers Submits like a scheduler and streams like decode worker `d<attempt>`. The output for the
    original prompt is `script`; a re-submitted prompt (original + k streamed tokens) continues at k.
    `plan[i]` is attempt i's behaviour: "ok", "die:N" (N tokens, then silence: no heartbeat ever
    comes), "error:N" (N tokens, then RequestError 503 naming the worker) or "gap:N" (N tokens, then
    one delta is skipped)."""

    bus: Bus
    script: list[int]
    plan: list[str]
    submits: list[Submit] = field(default_factory=list)
    cancels: set[str] = field(default_factory=set)
    refuse: int = 0  # re-submits (after the first attempt) refused 503 before one is taken
    refused: list[Submit] = field(default_factory=list)
    _tasks: set[asyncio.Task] = field(default_factory=set)

    async def start(self) -> None:
        await self.bus.subscribe(subjects.SCHED_SUBMIT, Submit, self._on_submit, concurrent=True)
        await self.bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel)
        await self.bus.flush()

    async def _on_cancel(self, c: Cancel) -> None:
        self.cancels.add(c.request_id)

    async def _on_submit(self, s: Submit) -> SubmitReply:
        if self.submits and len(self.refused) < self.refuse:  # as right after the only worker died
            self.refused.append(s)
            return SubmitReply(request_id=s.request_id, ok=False, code=503, message="no live decode worker")
        attempt = len(self.submits)
        self.submits.append(s)
        task = asyncio.get_running_loop().create_task(self._stream(s, attempt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return SubmitReply(request_id=s.request_id, ok=True, scheduler_id="sched-double")

    async def _stream(self, s: Submit, attempt: int) -> None:
        await asyncio.sleep(0)
        kind, _, n = self.plan[min(attempt, len(self.plan) - 1)].partition(":")
        stop_at = int(n) if n else None
        worker = f"d{attempt}"
        if kind == "ok":
            hb = WorkerHeartbeat(
                worker_id=worker, role=Role.DECODE, model=MODEL, running=1, waiting=0, free_pages=1,
                total_pages=1, page_size=16, max_context=128, interval_ms=5000, sent_ms=0,
            )  # fmt: skip
            await self.bus.publish(subjects.heartbeat_of(hb), hb)
        start = len(s.prompt_ids) - len(self.submits[0].prompt_ids)
        out = self.script[start : start + s.sampling.max_tokens]
        k, skipped = 0, False
        while k < len(out):
            if stop_at is not None and k >= stop_at:
                if kind == "error":
                    err = RequestError(
                        request_id=s.request_id, code=503, message=f"{worker} failed", worker_id=worker
                    )
                    await self.bus.publish(s.stream_subject, err)
                    return
                if kind == "die":
                    return
                if kind == "gap" and not skipped:
                    skipped, k = True, k + 2
                    continue
            ids = out[k : k + 2]
            final = k + len(ids) >= len(out)
            delta = TokenDelta(
                s.request_id, ids, finish=FinishReason.LENGTH if final else FinishReason.NONE, offset=k
            )
            await self.bus.publish(s.stream_subject, TokenBatch(deltas=[delta], worker_id=worker))
            k += len(ids)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture
async def scripted(nats_server: str, tokenizer: Tokenizer):
    bus = await Bus.connect(nats_server, "scripted-mesh")
    mesh = ScriptedMesh(bus, tokenizer.encode(TEXT, add_special_tokens=False), ["ok"])
    await mesh.start()
    yield mesh
    await mesh.stop()
    await bus.close()


def streamed_text(body: str) -> tuple[str, list[dict]]:
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    text = "".join(o["choices"][0]["text"] for o in objs if o.get("choices"))
    return text, objs


@pytest.mark.parametrize("failure", ["die:4", "error:4", "gap:4"])
async def test_stream_continues_on_a_new_attempt_without_repeating_or_skipping(
    start_gateway: StartGateway, scripted: ScriptedMesh, tokenizer: Tokenizer, failure: str
) -> None:
    scripted.plan = [failure, "ok"]
    gw = await start_gateway(max_migrations=2, dead_after_intervals=0.4)  # 100 ms of silence is death
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await post(base_url(gw), "/v1/completions", body)
    text, objs = streamed_text(r.text)
    assert text == tokenizer.decode(scripted.script[:12])
    assert objs[-1]["usage"]["completion_tokens"] == 12 and objs[-1]["usage"]["prompt_tokens"] == 3
    first, second = scripted.submits
    assert second.prompt_ids == [5, 6, 7] + scripted.script[:4]
    assert second.sampling.max_tokens == 8 and second.request_id != first.request_id
    assert second.avoid == ([] if failure.startswith("gap") else ["d0"])
    assert first.request_id in scripted.cancels  # whatever is left of the first attempt is dropped
    from prometheus_client import generate_latest

    assert "moemesh_gateway_migrations_total 1.0" in generate_latest(gw.registry).decode()


async def test_migrations_are_bounded_then_the_stream_ends_with_an_error(
    start_gateway: StartGateway, scripted: ScriptedMesh
) -> None:
    scripted.plan = ["error:2"]
    gw = await start_gateway(max_migrations=2)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 12, "stream": True}
    r = await post(base_url(gw), "/v1/completions", body)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["message"] == "d2 failed" and err["type"] == "service_unavailable_error"
    assert len(scripted.submits) == 3  # the first attempt and two migrations
    assert [len(s.prompt_ids) for s in scripted.submits] == [3, 5, 7]


@pytest.mark.parametrize("wait_s", [5.0, 0.0])
async def test_a_refused_migration_is_tried_again_for_migration_wait_s(
    start_gateway: StartGateway, scripted: ScriptedMesh, tokenizer: Tokenizer, wait_s: float
) -> None:
    """Right after the only worker died the mesh refuses the re-submit (503) until one is back: the gateway
    tries again, pausing 0.2 s doubling to 1 s, for migration_wait_s (at least submit_timeout_s)."""
    scripted.plan, scripted.refuse = ["error:4", "ok"], 3
    gw = await start_gateway(submit_timeout_s=0.3, migration_wait_s=wait_s)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 12, "stream": True}
    r = await post(base_url(gw), "/v1/completions", body)
    text, objs = streamed_text(r.text)
    if wait_s:
        assert text == tokenizer.decode(scripted.script[:12])
        assert len(scripted.refused) == 3 and len(scripted.submits) == 2
        ids = [s.request_id for s in scripted.refused] + [scripted.submits[1].request_id]
        assert len(set(ids)) == 4  # each try under a fresh id (a Cancel for an old one cannot hit it)
    else:  # within submit_timeout_s (0.3 s) only: one or two tries, and the stream ends with the refusal
        assert json.loads(sse_events(r.text)[-2])["error"]["message"] == "no live decode worker"
        assert 1 <= len(scripted.refused) < 3 and len(scripted.submits) == 1


async def test_non_streaming_request_migrates_too(
    start_gateway: StartGateway, scripted: ScriptedMesh, tokenizer: Tokenizer
) -> None:
    scripted.plan = ["die:6", "ok"]
    gw = await start_gateway(dead_after_intervals=0.4)
    r = await post(base_url(gw), "/v1/completions", {"model": MODEL, "prompt": [9, 9], "max_tokens": 10})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tokenizer.decode(scripted.script[:10])
