"""TTFT through the mesh vs the in-process engine on the same prompts, and streamed tokens/s under load.

    python -m bench.mesh_ttft [--requests 100] [--prompt-lens 5,40,200] [--clients 64]
                              [--prefix-index broker,local] [--overlap-prefill off,on]
                              [--scheduler process|embedded] [--client httpx,raw]
                              [--interleave-engine] [--per-request-step]

Starts the embedded mesh (nats-server, kv-broker, scheduler, prefill + decode worker, gateway; real
Mooncake TCP between the workers) on the tiny model, then:
1. sequential streaming completions (one at a time, max_tokens=1) per prompt length: TTFT = request sent
   -> first content chunk; the same prompts through an in-process Engine: add_request -> first token;
   the difference is what the mesh adds (HTTP, tokenizer-free token-id prompts, bus hops, KV transfer).
   With several `--client`s each request is sent once per client, in turn (the order alternating), so the
   clients see the same moments of the box: httpx (the record's `mesh` and `added_*`), and raw, libs.loadgen's
   lean HTTP/1.1 client (`moemesh bench --client raw`; vLLM's and SGLang's bench_serving use aiohttp), whose
   own parsing costs less of the client's share of TTFT (`by_client`).
   Beside it, the engine after 10 ms asleep before each request (`engine_after_idle`): a worker in the
   mesh idles between sequential requests, and on this VM a tiny-model step is slower after idle.
   With `--interleave-engine`, the engine on each prompt right after the mesh's requests for it
   (`engine_interleaved`): the same moments of the machine, so a drift of the box's speed over the run
   moves both; `paired_added` per client summarizes the per-prompt differences mesh - engine there.
   The worker that makes the first tokens (decode-0 direct, prefill-0 disaggregated) times its own engine
   steps (`moemesh_{decode,prefill}_step_seconds`): `in_mesh_step` is their mean over the measured requests,
   and `mesh_mean_minus_in_mesh_step_ms` per client the mesh's TTFT mean less it, the share that is not the
   model's step as the mesh ran it (on the direct path the decode step's time includes the hand-off).
   With `--per-request-step`, that worker's step-time sum is read after every request (a /metrics scrape of
   that one series, `?name[]=`, over one kept client, between two requests, served on the worker's loop
   while it idles; bench/NOTES-mesh.md says what it may disturb): the growth is that request's own step, and
   `own_share` per client summarizes, request by request, TTFT less its own step (p50 / p99 / mean).
2. `--clients` concurrent streaming clients, each generating `--gen-tokens`: total streamed tokens/s.
Writes bench/results/mesh_ttft.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.scale_load import FirstTextAndTail
from libs.chaos.workers import metric_total
from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh, MeshConfig
from libs.loadgen.raw_client import RawClient
from libs.loadgen.report import write_json

ENGINE_IDLE_S = 0.010  # the engine reference's idle before each request, for `engine_after_idle`
INTERLEAVED = "engine_interleaved"  # mesh_ttft's key for the engine's times taken between the requests
STEP = "step:"  # mesh_ttft's key prefix for a client's per-request step times (STEP + client)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def prompt_of(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 1000 + 3 for i in range(n)]


def engine_ttft(engine: Engine, prompts: list[list[int]], idle_s: float = 0.0) -> list[float]:
    """add_request -> first token, back to back; with idle_s, after that long asleep before each (as a
    worker in the mesh is between sequential requests: on this VM a step's time grows with the idle)."""
    out = []
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1)
    for i, p in enumerate(prompts):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        engine.add_request(f"b{i}", p, params)
        while not any(o.token_ids for o in engine.step()):
            pass
        out.append((time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished():
            engine.step()
    return out


def ttft_body(model: str, prompt: list[int]) -> dict:
    """A one-token streaming completion of a token-id prompt, as every TTFT probe here sends it."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "logprobs": 1,  # a chunk per token: no wait for a held-back partial UTF-8 character
    }


async def mesh_ttft(
    url: str,
    model: str,
    prompts: list[list[int]],
    clients: list[str],
    between: Callable[[list[int]], float] | None = None,
    step_sum: Callable[[], float] | None = None,
) -> dict[str, list[float]]:
    """Per client, the TTFT of each prompt (sequential; each prompt sent once per client, the clients'
    order alternating from one prompt to the next). With `between`, it is called with each prompt after
    the clients' requests (the in-process engine on the same prompt, at the same moment of the machine)
    and its times are under INTERLEAVED. With `step_sum` (seconds of model step so far, as the first
    token's worker counts them), it is read after each request and the growth, in ms, is under STEP + the
    client: that request's own step."""
    out: dict[str, list[float]] = {c: [] for c in clients}
    if between is not None:
        out[INTERLEAVED] = []
    last = 0.0
    if step_sum is not None:
        out.update({STEP + c: [] for c in clients})
        last = step_sum()
    raw = RawClient(url, keep=1)
    try:
        async with httpx.AsyncClient(timeout=60) as h:
            for i, p in enumerate(prompts):
                body = ttft_body(model, p)
                for c in clients if i % 2 == 0 else clients[::-1]:
                    ms = (
                        await first_token_ms(h, url, body)
                        if c == "httpx"
                        else await raw_first_token_ms(raw, body)
                    )
                    out[c].append(ms)
                    if step_sum is not None:
                        now = step_sum()
                        out[STEP + c].append((now - last) * 1e3)
                        last = now
                if between is not None:
                    out[INTERLEAVED].append(between(p))
    finally:
        await raw.aclose()
    return out


async def raw_first_token_ms(raw: RawClient, body: dict) -> float:
    """first_token_ms over the lean client (keep-alive, no HTTP library)."""
    sink = FirstTextAndTail(time.perf_counter())
    await raw.post("/v1/completions", json.dumps(body).encode(), {}, sink)
    if sink.status != 200 or sink.first is None:
        raise RuntimeError(f"raw client: HTTP {sink.status}, no token streamed: {sink.tail[-200:]!r}")
    return sink.first * 1e3


async def first_token_ms(h: httpx.AsyncClient, url: str, body: dict) -> float:
    """Milliseconds from sending a streaming completion to its first token's SSE chunk (the stream is read
    to its end); RuntimeError when no token came."""
    t0 = time.perf_counter()
    first = None
    async with h.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = (time.perf_counter() - t0) * 1e3
    if first is None:
        raise RuntimeError(f"{url}: no token streamed")
    return first


async def load(url: str, model: str, clients: int, gen_tokens: int, prompt_len: int) -> dict:
    async def one(h: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": model, "prompt": prompt_of(prompt_len, 1000 + i), "max_tokens": gen_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        n = 0
        async with h.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                    n = json.loads(line[6:])["usage"]["completion_tokens"]
        return n

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as h:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(h, i) for i in range(clients)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "gen_tokens": gen_tokens, "prompt_len": prompt_len, "tokens": sum(counts),
            "wall_s": wall, "tokens_per_s": sum(counts) / wall}  # fmt: skip


def step_totals(metrics_url: str, metric: str) -> tuple[float, float]:
    """(sum, count) of a worker's step-time histogram."""
    return metric_total(metrics_url, metric + "_sum"), metric_total(metrics_url, metric + "_count")


def in_mesh_steps(before: tuple[float, float], after: tuple[float, float], worker: str, metric: str) -> dict:
    """The mean engine step of the worker that made the first tokens, over the measured requests (from its
    own histogram): TTFT's model share as the mesh ran it, beside the in-process engine's."""
    n = after[1] - before[1]
    return {"worker": worker, "metric": metric, "steps": n,
            "mean_ms": (after[0] - before[0]) / n * 1e3 if n else float("nan")}  # fmt: skip


class StepSum:
    """A worker's step-time sum in seconds, read from its /metrics filtered to that one series, over one
    kept client (`httpx.get` would build a client, and its TLS context, per read: garbage the next request's
    client would collect)."""

    def __init__(self, metrics_url: str, metric: str) -> None:
        self.name = metric + "_sum"
        self.url = f"{metrics_url}?name[]={self.name}"
        self.http = httpx.Client(timeout=10)

    def __call__(self) -> float:
        text = self.http.get(self.url).raise_for_status().text
        values = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.split(" ", 1)[0] == self.name]
        if len(values) != 1:
            raise RuntimeError(f"{self.url}: expected one {self.name} line, got {len(values)}")
        return values[0]

    def close(self) -> None:
        self.http.close()


def own_share(steps_ms: list[float], ttft_ms: list[float]) -> dict:
    """Request by request, TTFT less that request's own step in the mesh (the share that is not the
    model's), with the steps' own summary beside it."""
    return {**summarize([t - s for t, s in zip(ttft_ms, steps_ms, strict=True)]), "step": summarize(steps_ms)}


def summarize(xs: list[float]) -> dict:
    return {
        "p50_ms": statistics.median(xs),
        "p99_ms": pct(xs, 99),
        "mean_ms": statistics.fmean(xs),
        "n": len(xs),
    }


def ttft_row(
    prompt_len: int,
    path: str,
    engine: dict,
    engine_idle: dict,
    per_client: dict[str, dict],
    interleaved: dict | None = None,
    paired: dict[str, dict] | None = None,
) -> dict:
    """One prompt length's record: the first client's mesh TTFT against the engine's (`mesh`, `added_*`),
    and every client's (`by_client`); beside the goal's measure, diagnostics: the mesh against the engine
    after idle, and (given `interleaved`, the engine run between the mesh's requests, and `paired`, each
    client's summary of the per-prompt differences mesh - engine there) against the engine at the same
    moments of the machine."""

    def added(c: str, x: dict) -> dict:
        out = {"added_p50_ms": x["p50_ms"] - engine["p50_ms"],
               "added_p99_ms": x["p99_ms"] - engine["p99_ms"],
               "added_vs_idle_engine_p50_ms": x["p50_ms"] - engine_idle["p50_ms"]}  # fmt: skip
        if interleaved is not None:
            out["added_vs_interleaved_engine_p50_ms"] = x["p50_ms"] - interleaved["p50_ms"]
            out["added_vs_interleaved_engine_p99_ms"] = x["p99_ms"] - interleaved["p99_ms"]
        if paired is not None:
            out["paired_added"] = paired[c]
        return out

    first = next(iter(per_client))
    row = {"prompt_len": prompt_len, "path": path, "engine": engine, "engine_after_idle": engine_idle,
           "client": first, "mesh": per_client[first], **added(first, per_client[first]),
           "by_client": {c: {"mesh": x, **added(c, x)} for c, x in per_client.items()}}  # fmt: skip
    if interleaved is not None:
        row["engine_interleaved"] = interleaved
    return row


def measure(
    model: Path, engine: Engine, lens: list[int], prefix_index: str, overlap: bool, args: argparse.Namespace
):
    """Per prompt length, TTFT through a fresh mesh whose scheduler reads prefix hits from `prefix_index`
    (local replica or kv-broker query) vs the in-process engine; then the concurrent load."""
    cfg = MeshConfig(
        model_dir=model, port=0, embedded_scheduler=args.scheduler == "embedded",
        extra_env={
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(args.direct_threshold),
                                   "MOEMESH_SCHEDULER_PREFIX_INDEX": prefix_index,
                                   "MOEMESH_SCHEDULER_OVERLAP_PREFILL": str(overlap).lower()},
            "services.prefill_worker": {"MOEMESH_PREFILL_WORKER_ENABLE_PREFIX_CACHE": "false"},
            "services.decode_worker": {"MOEMESH_DECODE_WORKER_ENABLE_PREFIX_CACHE": "false"},
        },
    )  # fmt: skip
    rows = []
    clients = args.client.split(",")
    with Mesh(cfg) as mesh:
        for n in lens:
            prompts = [prompt_of(n, i) for i in range(args.requests)]
            asyncio.run(mesh_ttft(mesh.url, mesh.model_name, prompts[:5], clients))  # warm-up
            engine_ttft(engine, prompts[:5])
            e = summarize(engine_ttft(engine, prompts))
            e_idle = summarize(engine_ttft(engine, prompts, ENGINE_IDLE_S))
            direct = n <= args.direct_threshold
            worker, metric = (
                ("decode-0", "moemesh_decode_step_seconds")
                if direct
                else ("prefill-0", "moemesh_prefill_step_seconds")
            )
            before = step_totals(mesh.metrics_url(worker), metric)
            between = (lambda p: engine_ttft(engine, [p])[0]) if args.interleave_engine else None
            step_sum = StepSum(mesh.metrics_url(worker), metric) if args.per_request_step else None
            try:
                times = asyncio.run(mesh_ttft(mesh.url, mesh.model_name, prompts, clients, between, step_sum))
            finally:
                if step_sum is not None:
                    step_sum.close()
            steps = in_mesh_steps(before, step_totals(mesh.metrics_url(worker), metric), worker, metric)
            inter = times.pop(INTERLEAVED, None)
            own = {c: own_share(times.pop(STEP + c), times[c]) for c in clients if STEP + c in times}
            per = {c: summarize(xs) for c, xs in times.items()}
            paired = inter and {
                c: summarize([a - b for a, b in zip(xs, inter, strict=True)]) for c, xs in times.items()
            }
            path = "direct (decode-local prefill)" if direct else "disaggregated (Mooncake TCP)"
            row = ttft_row(n, path, e, e_idle, per, inter and summarize(inter), paired)
            row["in_mesh_step"] = steps
            for c, x in row["by_client"].items():
                x["mesh_mean_minus_in_mesh_step_ms"] = per[c]["mean_ms"] - steps["mean_ms"]
                if c in own:
                    x["own_share"] = own[c]
            row.update(prefix_index=prefix_index, overlap_prefill=overlap)
            rows.append(row)
            print(json.dumps(row), flush=True)
        load_row = asyncio.run(load(mesh.url, mesh.model_name, args.clients, args.gen_tokens, 40))
        print(json.dumps(load_row), flush=True)
    return rows, load_row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--prompt-lens", default="5,40,200")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: a fresh tiny model)")
    ap.add_argument("--direct-threshold", type=int, default=16, help="scheduler's direct-prefill threshold")
    ap.add_argument("--out", default="bench/results/mesh_ttft.json")
    ap.add_argument(
        "--prefix-index", default="local",
        help="scheduler prefix index per run, comma-separated (broker,local: an A/B on one machine state)",
    )  # fmt: skip
    ap.add_argument(
        "--overlap-prefill", default="on", help="overlap_prefill per run: on (the default), off, off,on"
    )
    ap.add_argument(
        "--scheduler", choices=["process", "embedded"], default="process",
        help="embedded: no scheduler process, the gateway hosts one (moemesh up --scheduler embedded)",
    )  # fmt: skip
    ap.add_argument(
        "--client", default="httpx,raw",
        help="HTTP clients, comma-separated, each request sent once per client in turn: httpx (the record's "
        "`mesh`/`added_*` when first), raw (libs.loadgen's lean client)",
    )  # fmt: skip
    ap.add_argument(
        "--interleave-engine", action="store_true",
        help="also run the in-process engine on each prompt right after the mesh's requests for it "
        "(`engine_interleaved`, `paired_added`); its steps share the machine's caches with the workers'",
    )  # fmt: skip
    ap.add_argument(
        "--per-request-step", action="store_true",
        help="read the first token's worker's step-time sum after each request (a /metrics scrape between "
        "requests): `own_share` per client, request by request TTFT less its own step",
    )  # fmt: skip
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of the in-process engine (workers use 1)"
    )
    args = ap.parse_args()
    if unknown := set(args.client.split(",")) - {"httpx", "raw"}:
        ap.error(f"--client: unknown {sorted(unknown)} (httpx, raw)")
    import torch

    torch.set_num_threads(args.threads)

    model = (
        Path(args.model) if args.model else write_tiny_model(Path("/tmp/moemesh-bench-tiny"), overwrite=True)
    )
    lens = [int(x) for x in args.prompt_lens.split(",")]
    engine = Engine.from_pretrained(model, enable_prefix_cache=False)
    results: dict = {
        "benchmark": "mesh_ttft",
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "torch_threads": args.threads,
        "scheduler": args.scheduler,
        "command": "python -m bench.mesh_ttft " + " ".join(sys.argv[1:]),
        "load_avg_before": os.getloadavg(),
        "ttft": [],
    }
    # every run's rows are in prefix_index_ab; `ttft` holds the defaults' (local, overlap on) if run
    for kind in args.prefix_index.split(","):
        for overlap in (o == "on" for o in args.overlap_prefill.split(",")):
            rows, load_row = measure(model, engine, lens, kind, overlap, args)
            key = kind + ("+overlap" if overlap else "")
            results.setdefault("prefix_index_ab", {})[key] = {"ttft": rows, "load_avg": os.getloadavg()}
            results["ttft"], results["load"] = rows, load_row
    if "local+overlap" in results["prefix_index_ab"]:  # the record's `ttft` is the default configuration's
        results["ttft"] = results["prefix_index_ab"]["local+overlap"]["ttft"]
    results["load_avg_after"] = os.getloadavg()
    print(f"wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
