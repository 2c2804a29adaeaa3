"""Prefix-aware routing through the real mesh (2 prefill workers, 1 decode worker, every prompt
disaggregated): multi-turn chats whose second turn goes to the prefill worker holding the first turn's
KV blocks (known to the kv-broker from the workers' KV events), reports cached tokens, and receives
from the decode worker's own cache the part of the prompt it decoded before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import openai
import pytest

from libs.chaos import metric_total
from libs.launch.mesh import Mesh, MeshConfig
from libs.prefix import block_hashes
from libs.tokenizer import Tokenizer
from proto import decoder, encode, subjects
from proto import messages as m

pytestmark = pytest.mark.e2e

PAGE = 16  # the workers' default page size
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    cfg = MeshConfig(
        model_dir=tiny_model,
        port=0,
        prefill_workers=2,
        decode_workers=1,
        log_dir=tmp_path_factory.mktemp("prefix-mesh-logs"),
        # a full hit outweighs 8 queued requests: more than the 4 conversations can unbalance the two
        # workers, so the cache decides every placement here (weight vs load is the policy's unit test)
        extra_env={
            "services.scheduler": {
                "MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "0",
                "MOEMESH_SCHEDULER_PREFIX_WEIGHT": "8",
            }
        },
    )
    with Mesh(cfg) as mesh:
        yield mesh


class Tasks:
    """Every PrefillTask on the bus, with the prefill worker it was sent to (not the PrefillStarts that go
    ahead of them: overlap_prefill)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, m.PrefillTask]] = []
        self._dec = decoder(m.PrefillInbox)

    async def on_msg(self, msg) -> None:
        if isinstance(task := self._dec.decode(msg.data), m.PrefillTask):
            self.seen.append((msg.subject.rsplit(".", 1)[-1], task))

    def extending(self, prompt: list[int]) -> list[tuple[str, m.PrefillTask]]:
        """Tasks whose prompt starts with `prompt` and goes on (the turns that follow it)."""
        return [
            (w, t)
            for w, t in self.seen
            if len(t.prompt_ids) > len(prompt) and t.prompt_ids[: len(prompt)] == prompt
        ]


def system_prompt(i: int) -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    return f"You are assistant number {i}. " + " ".join(words[(i + k) % 10] + str(k) for k in range(120))


async def chat(client: openai.AsyncOpenAI, model: str, messages: list[dict]) -> tuple[str, int]:
    r = await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens_details.cached_tokens or 0


async def index_knows(nc, prompt: list[int], worker: str) -> None:
    """Until the kv-broker's index answers that `worker` holds the prompt's full pages."""
    q = m.PrefixQuery(page_size=PAGE, hashes=block_hashes(prompt, PAGE))
    want = len(prompt) // PAGE * PAGE
    deadline = time.monotonic() + TIMEOUT
    while True:
        reply = decoder(m.PrefixReply).decode(
            (await nc.request(subjects.BROKER_PREFIX, encode(q), timeout=5)).data
        )
        if reply.cached_tokens.get(worker, 0) >= want:
            return
        assert time.monotonic() < deadline, f"index never showed {worker} holding the prompt: {reply}"
        await asyncio.sleep(0.05)  # the index follows the workers' events asynchronously


async def test_second_turn_goes_to_the_prefill_worker_holding_the_first(mesh: Mesh, tiny_model: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_model)
    nc = await nats.connect(mesh.nats_url)
    tasks = Tasks()
    await nc.subscribe(subjects.prefill_inbox("*"), cb=tasks.on_msg)
    client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    model = (await client.models.list()).data[0].id
    n, rounds = 4, 4
    try:
        # first turns, 4 at once: placed on load alone (nothing cached yet), so both prefill workers get some,
        # unless a loaded machine serialized them (each then finds both workers idle, and ties go to the
        # first id): then 4 more conversations, until both workers hold some
        convs: list[list[dict]] = []
        replies: list[tuple[str, int]] = []
        first: dict[int, tuple[str, list[int]]] = {}
        for _ in range(rounds):
            batch = [[{"role": "system", "content": system_prompt(i)}, {"role": "user", "content": f"Hi {i}"}]
                     for i in range(len(convs), len(convs) + n)]  # fmt: skip
            replies += await asyncio.gather(*(chat(client, model, c) for c in batch))
            convs += batch
            for worker, task in tasks.seen:
                (i,) = [
                    i for i in range(len(convs)) if f"assistant number {i}." in tok.decode(task.prompt_ids)
                ]
                first[i] = (worker, task.prompt_ids)
            if {w for w, _ in first.values()} == set(mesh.worker_ids(m.Role.PREFILL)):
                break
        assert all(cached == 0 for _, cached in replies)
        assert sorted(first) == list(range(len(convs)))
        assert {w for w, _ in first.values()} == set(mesh.worker_ids(m.Role.PREFILL)), first
        for worker, prompt in first.values():
            await index_knows(nc, prompt, worker)

        # second turns, at once and in the opposite order: load alone would now place them differently
        for c, (text, _) in zip(convs, replies, strict=True):
            c += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
        tasks.seen.clear()
        second = await asyncio.gather(*(chat(client, model, convs[i]) for i in reversed(range(len(convs)))))
        for i, (_, cached) in zip(reversed(range(len(convs))), second, strict=True):
            worker, prompt = first[i]
            ((worker2, task2),) = tasks.extending(prompt)
            assert worker2 == worker, f"conversation {i}: turn 1 on {worker}, turn 2 on {worker2}"
            assert cached >= len(prompt) // PAGE * PAGE > 0  # the first turn's full pages were reused
            # and the decode worker received only what it did not hold from the first turn
            assert task2.handle.cached_tokens >= len(prompt) // PAGE * PAGE
        # what the operators see: each worker's prefix hit rate, the broker's index size
        for w in mesh.worker_ids(m.Role.PREFILL):
            assert metric_total(mesh.metrics_url(w), "moemesh_prefill_prefix_cache_hit_rate") > 0
        assert metric_total(mesh.metrics_url("decode-0"), "moemesh_decode_prefix_cache_hit_rate") > 0
        assert metric_total(mesh.metrics_url("kv-broker"), "moemesh_kv_broker_prefix_entries") > 0
    finally:
        await client.close()
        await nc.close()
