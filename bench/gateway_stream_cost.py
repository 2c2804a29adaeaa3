"""The gateway's per-token Python cost on the streaming path, in process and without the network: the
deltas a TokenBatch carries go into each request's inbox as MeshClient routes them, and the SSE event
generator of app.py turns them into bytes (Generation.steps, migration bookkeeping, metrics,
ChoiceOutput.feed with the incremental detokenizer, chunk formatting). Not measured here: the bus
(nats-py, msgspec decode of the batch), Starlette/uvicorn's send and the socket write, which
bench.mesh_scale's streaming test includes.

    python -m bench.gateway_stream_cost [--requests 256 --tokens 256] [--chat] [--continuous-usage]

One token per delta, every request advanced once per round (a decode step's batch); prints CPU
microseconds per token (process time, the best of --repeat runs: the box is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

from libs.engine.tiny import write_tiny_model
from libs.tokenizer import Tokenizer
from proto.messages import FinishReason, TokenDelta
from services.gateway.app import _sse_events
from services.gateway.convert import ModelInfo, plan_chat, plan_completion
from services.gateway.generation import Generation
from services.gateway.metrics import GatewayMetrics
from services.gateway.output import TokenText
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest


class _Mesh:
    """What Generation asks of MeshClient, without a bus."""

    stream_subject = "mesh.stream.bench"

    def open(self, request_id: str, queue: Any, tag: int) -> None:
        pass

    def close(self, request_id: str, reason: str | None = None) -> None:
        pass


async def run(tok: Tokenizer, info: ModelInfo, args: argparse.Namespace) -> float:
    metrics, tokens, mesh = GatewayMetrics(), TokenText(tok), _Mesh()
    body = {"model": info.name, "max_tokens": args.tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": args.continuous_usage}}  # fmt: skip
    if args.chat:
        plan = plan_chat(
            ChatCompletionRequest.model_validate({**body, "messages": [{"role": "user", "content": "hi"}]}),
            tok,
            info,
        )
    else:
        plan = plan_completion(
            CompletionRequest.model_validate({**body, "prompt": "Once upon a time"}), tok, info
        )
    now = time.monotonic()
    gens = [Generation(mesh, plan, tok, tokens, info.name, metrics, arrival=now, deadline=now + 3600,  # type: ignore[arg-type]
                       id_prefix="cmpl") for _ in range(args.requests)]  # fmt: skip
    script = tok.encode(
        " The quick brown fox jumps over the lazy dog; naive cafe, ok." * 8, add_special_tokens=False
    )
    if args.random_ids:  # like the sim engine's tokens: any id of the vocabulary, byte pieces included
        rng = random.Random(0)
        script = [rng.randrange(tok.vocab_size) for _ in range(997)]
    nbytes = 0

    async def client(g: Generation) -> None:  # what StreamingResponse does with the events, minus send
        nonlocal nbytes
        async for chunk in _sse_events(g, args.chat, lambda status: None):
            nbytes += len(chunk)

    tasks = [asyncio.create_task(client(g)) for g in gens]
    await asyncio.sleep(0)
    t0 = time.process_time()
    for k in range(args.tokens):  # one decode step: a token for every request, then the loop runs them
        fin = FinishReason.LENGTH if k == args.tokens - 1 else FinishReason.NONE
        for g in gens:
            g.queue.put_nowait(
                (0, TokenDelta(g.request_ids[0], [script[k % len(script)]], offset=k, finish=fin))
            )
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    cpu = time.process_time() - t0
    return cpu / (args.tokens * args.requests) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument(
        "--random-ids", action="store_true", help="random token ids (as the sim engine's) instead of text"
    )
    ap.add_argument("--continuous-usage", action="store_true", help="usage in every chunk (moemesh bench's slow-down)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = write_tiny_model(Path("/tmp/moemesh-bench-gwcost"), overwrite=True)
    tok = Tokenizer.from_pretrained(model)
    info = ModelInfo.from_dir(model, "tiny")
    us = min(asyncio.run(run(tok, info, args)) for _ in range(args.repeat))
    print(json.dumps({"us_per_token": us, "tokens_per_cpu_s": 1e6 / us, "requests": args.requests,
                      "tokens": args.tokens, "chat": args.chat, "random_ids": args.random_ids,
                      "continuous_usage": args.continuous_usage}))  # fmt: skip


if __name__ == "__main__":
    main()
