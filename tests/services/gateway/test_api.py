"""The gateway through the official `openai` client, against a real nats-server and a scripted mesh."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from libs.tokenizer import Tokenizer
from proto.messages import Sampling
from services.gateway.service import Gateway
from tests.services.gateway.conftest import MODEL
from tests.services.gateway.fake_mesh import TEXT, FakeMesh

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def script_text(tokenizer: Tokenizer, n_tokens: int) -> str:
    return tokenizer.decode(tokenizer.encode(TEXT, add_special_tokens=False)[:n_tokens])


async def test_chat_non_streaming(
    client: openai.AsyncOpenAI, fake_mesh: FakeMesh, tokenizer: Tokenizer
) -> None:
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=9, temperature=0.3, top_p=0.8, seed=5,
        extra_body={"top_k": 4, "min_p": 0.05, "stop_token_ids": [7], "ignore_eos": True},
    )  # fmt: skip
    (sub,) = fake_mesh.submits
    assert sub.prompt_ids == tokenizer.encode_chat(MESSAGES) and sub.model == MODEL
    assert sub.sampling == Sampling(
        max_tokens=9,
        temperature=0.3,
        top_p=0.8,
        top_k=4,
        min_p=0.05,
        seed=5,
        stop_token_ids=[7],
        ignore_eos=True,
    )
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == script_text(tokenizer, 9)
    assert choice.finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(sub.prompt_ids), 9)
    assert r.usage.total_tokens == len(sub.prompt_ids) + 9
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 3


async def test_chat_streaming_with_usage(
    client: openai.AsyncOpenAI, fake_mesh: FakeMesh, tokenizer: Tokenizer
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=100,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    first, *middle, last_choice, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert len(middle) >= 3, "tokens arrive over several chunks"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT  # the script ran to EOS, which is not rendered
    assert last_choice.choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert usage.choices == [] and usage.usage is not None
    n_out = len(tokenizer.encode(TEXT, add_special_tokens=False)) + 1
    assert usage.usage.completion_tokens == n_out
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("chat", [True, False])
async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    client: openai.AsyncOpenAI, fake_mesh: FakeMesh, tokenizer: Tokenizer, chat: bool
) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens streamed so far."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=100, stream=True, stream_options=opts  # type: ignore[arg-type]
        )
    else:
        stream = await client.completions.create(
            model=MODEL, prompt="hello", max_tokens=100, stream=True, stream_options=opts  # type: ignore[arg-type]
        )
    chunks = [c async for c in stream]
    n_out = len(tokenizer.encode(TEXT, add_special_tokens=False)) + 1
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == n_out
    assert len(set(counts)) >= 4, "the count grows chunk by chunk"
    prompt = chunks[-1].usage.prompt_tokens if chunks[-1].usage else None
    assert all(c.usage.prompt_tokens == prompt for c in chunks if c.usage is not None)
    assert chunks[-1].choices == []  # the usage chunk still ends the stream
    plain = await client.completions.create(
        model=MODEL, prompt="hello", max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    assert all(c.usage is None for c in [c async for c in plain][:-1]), "off unless asked for"


async def test_continuous_usage_sends_a_chunk_for_tokens_without_text(
    client: openai.AsyncOpenAI, fake_mesh: FakeMesh, tokenizer: Tokenizer
) -> None:
    """A model's vocab padded past the tokenizer's (the GPU test checkpoints) streams ids with no text: with
    continuous usage each step still sends its chunk, so a client sees tokens arrive as they are made (vLLM's
    completions do); without it, chunks carry text only."""
    fake_mesh.ids = [tokenizer.vocab_size + k for k in range(12)]  # 6 steps of 2 ids, none with text
    opts = {"include_usage": True, "continuous_usage_stats": True}
    stream = await client.completions.create(
        model=MODEL, prompt="hello", max_tokens=12, stream=True, stream_options=opts  # type: ignore[arg-type]
    )
    chunks = [c async for c in stream]
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts == [2, 4, 6, 8, 10, 12]
    assert all(c.choices[0].text == "" for c in chunks if c.choices)
    plain = await client.completions.create(
        model=MODEL, prompt="hello", max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    assert [c.choices[0].finish_reason for c in [c async for c in plain] if c.choices] == ["length"]


async def test_completions_several_prompts_and_n(
    client: openai.AsyncOpenAI, fake_mesh: FakeMesh, tokenizer: Tokenizer
) -> None:
    r = await client.completions.create(model=MODEL, prompt=["one", "two"], n=2, max_tokens=4, seed=100)
    assert r.object == "text_completion"
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == script_text(tokenizer, 4) and c.finish_reason == "length" for c in r.choices)
    by_id = {s.request_id: s for s in fake_mesh.submits}
    assert len(by_id) == 4, "n separate mesh requests"
    seeds = sorted((s.prompt_ids == tokenizer.encode("two"), s.sampling.seed) for s in by_id.values())
    assert seeds == [(False, 100), (False, 101), (True, 100), (True, 101)]
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tokenizer.encode("one")) + len(tokenizer.encode("two"))
    assert r.usage.completion_tokens == 16


async def test_completions_streaming_token_ids(
    client: openai.AsyncOpenAI, fake_mesh: FakeMesh, tokenizer: Tokenizer
) -> None:
    stream = await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=6, stream=True)
    chunks = [c async for c in stream]
    assert fake_mesh.submits[0].prompt_ids == [5, 6, 7]
    assert "".join(c.choices[0].text for c in chunks) == script_text(tokenizer, 6)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "text_completion" for c in chunks)


async def test_chat_logprobs(client: openai.AsyncOpenAI, fake_mesh: FakeMesh, tokenizer: Tokenizer) -> None:
    r = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2
    )
    assert fake_mesh.submits[0].sampling.logprobs and fake_mesh.submits[0].sampling.top_logprobs == 2
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:5]
    assert [c.token for c in content] == [tokenizer.decode([i]) for i in ids]
    assert [c.logprob for c in content] == [-0.125 * (k + 1) for k in range(5)]
    assert b"".join(bytes(c.bytes) for c in content).decode() == r.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert content[0].top_logprobs[1].logprob == content[0].logprob - 1


async def test_completions_logprobs_streaming(
    client: openai.AsyncOpenAI, fake_mesh: FakeMesh, tokenizer: Tokenizer
) -> None:
    stream = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5, logprobs=1, stream=True)
    tokens, offsets, text = [], [], ""
    async for c in stream:
        lp = c.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens or []
            offsets += lp.text_offset or []
            assert all(len(t) == 1 for t in lp.top_logprobs or [])
        text += c.choices[0].text
    assert "".join(tokens) == text == script_text(tokenizer, 5)
    assert offsets == [len("".join(tokens[:k])) for k in range(len(tokens))]


async def test_return_tokens_as_token_ids_names_the_ids_the_mesh_sent(
    client: openai.AsyncOpenAI, tokenizer: Tokenizer
) -> None:
    r = await client.completions.create(
        model=MODEL, prompt="hi", max_tokens=6, logprobs=1, extra_body={"return_tokens_as_token_ids": True}
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None
    want = [f"token_id:{t}" for t in tokenizer.encode(TEXT, add_special_tokens=False)[:6]]
    assert lp.tokens == want and [next(iter(t)) for t in lp.top_logprobs] == want
    assert r.choices[0].text == script_text(tokenizer, 6)


async def test_stop_string_truncates_and_cancels_the_worker(
    client: openai.AsyncOpenAI, fake_mesh: FakeMesh, gateway: Gateway
) -> None:
    fake_mesh.mode = "forever"
    r = await client.completions.create(model=MODEL, prompt="hi", max_tokens=100, stop=["prompt", "zz"])
    assert r.choices[0].text == TEXT[: TEXT.index("prompt")] and r.choices[0].finish_reason == "stop"
    (sub,) = fake_mesh.submits
    cancel = await fake_mesh.wait_cancel(sub.request_id)
    assert cancel.reason == "stop string"
    assert r.usage is not None and r.usage.completion_tokens < 100


async def test_models_health_metrics(client: openai.AsyncOpenAI, url: str, fake_mesh: FakeMesh) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    async with httpx.AsyncClient(base_url=url) as h:
        health = await h.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        await h.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
        text = (await h.get("/metrics")).text
    assert 'moemesh_gateway_requests_total{endpoint="chat",status="200"} 1.0' in text
    assert 'moemesh_gateway_requests_total{endpoint="chat",status="404"} 1.0' in text
    assert "moemesh_gateway_ttft_seconds_count 1.0" in text
    assert "moemesh_gateway_itl_seconds_count" in text
    assert "moemesh_gateway_generation_tokens_total 3.0" in text
    assert "moemesh_gateway_requests_in_flight 0.0" in text
    assert "moemesh_gateway_mesh_requests_in_flight 0.0" in text


async def test_responses_are_not_held_by_nagle(url: str) -> None:
    """Without TCP_NODELAY on accepted sockets every response waits for a delayed ACK (~40 ms)."""
    async with httpx.AsyncClient(base_url=url) as h:
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            assert (await h.get("/v1/models")).status_code == 200
            times.append(time.perf_counter() - t0)
    assert sorted(times)[10] < 0.02, f"median GET /v1/models took {sorted(times)[10] * 1000:.1f} ms"
