"""KV tiers on a multi-turn workload through the mesh `moemesh up` starts: tiers off, a host tier, and a host
tier plus the shared Mooncake Store, one after the other in one run, on the same requests.

    python -m bench.kv_tiers [--sessions 200] [--turns 3] [--concurrency 16] [--num-pages 48]
                             [--host-kv-pages 2048] [--device cpu|cuda] [--preset v3-width] [--out PATH]

Workload: `--sessions` chats sharing a `--system-len`-token system prompt; each turn adds `--user-len` user
tokens to the chat so far (its replies included: token ids come back with the logprobs) and asks for
`--gen-tokens` greedy tokens. A turn of every chat is sent (shuffled, `--concurrency` at a time) before
the next turn. The working set (every chat's last context, the shared system prompt once) is reported
against the device KV pages of all workers (`--num-pages` each): the default is about 5x the pool. Each configuration starts its own
mesh with up's flags (`--num-pages`, `--host-kv-pages`, `--kv-store`), warms up on other prompts, then
runs the workload; per configuration: prompt tokens computed (prompt - cached, from each response's
usage), TTFT p50/p99 (streamed, first text chunk), output tokens/s over the workload's wall time, and the
workers' per-tier metrics. Writes bench/results/kv_tiers-<device>.json (or --out). Leaves out: model
quality (random weights), sampling other than greedy, requests that overlap turns of one chat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from libs.chaos.workers import metric_total
from libs.cli import up
from libs.launch.mesh import Mesh
from libs.loadgen.report import provenance, write_json
from proto import messages as m

CONFIGS = {"off": [], "host": ["host"], "host+store": ["host", "store"]}
TIER_METRICS = {
    "hit_pages_device": 'moemesh_kv_tier_hit_pages_total{tier="device"}',
    "hit_pages_host": 'moemesh_kv_tier_hit_pages_total{tier="host"}',
    "hit_pages_store": 'moemesh_kv_tier_hit_pages_total{tier="store"}',
    "bytes_device_to_host": 'moemesh_kv_tier_bytes_total{direction="device_to_host"}',
    "bytes_host_to_device": 'moemesh_kv_tier_bytes_total{direction="host_to_device"}',
    "bytes_store_to_host": 'moemesh_kv_tier_bytes_total{direction="store_to_host"}',
    "bytes_host_to_store": 'moemesh_kv_tier_bytes_total{direction="host_to_store"}',
    "store_failures": "moemesh_kv_store_failures_total",
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_tiers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=64)
    ap.add_argument("--user-len", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=48, help="device KV pages per worker")
    ap.add_argument("--host-kv-pages", type=int, default=2048, help="host tier pages per worker")
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="", help="a checkpoint folder (default: the tiny model, or --preset)")
    ap.add_argument("--preset", default="", choices=["", "v3-width"], help="write DeepSeek-V3's width (GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="record path (default bench/results/kv_tiers-<device>.json)")
    a = ap.parse_args(argv)
    unknown = set(a.configs.split(",")) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown --configs {sorted(unknown)}; choose from {list(CONFIGS)}")
    return a


def model_dir(a: argparse.Namespace, tmp: Path) -> Path:
    if a.model:
        return Path(a.model)
    if a.preset:
        from libs.engine.preset_model import write_preset_model

        path = write_preset_model(tmp / "v3-width")
        if a.device == "cuda":
            import torch

            torch.cuda.empty_cache()
        return path
    from libs.engine.tiny import write_tiny_model

    return write_tiny_model(tmp / "tiny-v3", seed=0)


def up_args(a: argparse.Namespace, model: Path, log_dir: Path, tiers: list[str]) -> list[str]:
    """`moemesh up`'s command line for one configuration."""
    args = ["up", "--model", str(model), "--port", "0", "--log-dir", str(log_dir), "--device", a.device,
            "--prefill-workers", str(a.prefill_workers), "--decode-workers", str(a.decode_workers),
            "--page-size", str(a.page_size), "--num-pages", str(a.num_pages)]  # fmt: skip
    if "host" in tiers:
        args += ["--host-kv-pages", str(a.host_kv_pages)]
    if "store" in tiers:
        args += ["--kv-store"]
    return args


def start_mesh(args: list[str]) -> Mesh:
    p = argparse.ArgumentParser()
    up.add_parser(p.add_subparsers(dest="command"))
    ns = p.parse_args(args)
    cfg, worker = up.mesh_config(ns, os.environ)
    return Mesh(cfg).start(timeout=up.ready_timeout(None, worker.device))


def chats(a: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(a.seed)
    system = [rng.randrange(3, vocab) for _ in range(a.system_len)]
    return system, [[rng.randrange(3, vocab) for _ in range(a.user_len)] for _ in range(a.sessions)]


def user_turn(a: argparse.Namespace, session: int, turn: int, vocab: int) -> list[int]:
    rng = random.Random(a.seed * 1_000_003 + session * 101 + turn)
    return [rng.randrange(3, vocab) for _ in range(a.user_len)]


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], n: int) -> dict[str, Any]:
    """A streamed completion: TTFT (first text chunk), the generated ids, and the usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": 1,
            "return_tokens_as_token_ids": True}  # fmt: skip
    t0, ttft, ids, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                if ttft is None and c.get("text"):
                    ttft = time.perf_counter() - t0
                ids += [
                    int(t.removeprefix("token_id:")) for t in (c.get("logprobs") or {}).get("tokens") or []
                ]
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "ids": ids, "prompt": usage.get("prompt_tokens", len(prompt)),
            "cached": details.get("cached_tokens") or 0, "completion": usage.get("completion_tokens", len(ids))}  # fmt: skip


async def workload(a: argparse.Namespace, mesh: Mesh, vocab: int) -> dict[str, Any]:
    system, first = chats(a, vocab)
    contexts = [system + u for u in first]
    sem = asyncio.Semaphore(a.concurrency)
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=mesh.url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        warm = [[(7 * i + k) % (vocab - 3) + 3 for i in range(a.system_len)] for k in range(a.concurrency)]
        await asyncio.gather(*(one(client, model, p, a.gen_tokens) for p in warm))  # compile, connect
        t0 = time.perf_counter()
        for turn in range(a.turns):
            order = list(range(a.sessions))
            random.Random(a.seed + turn).shuffle(order)

            async def send(s: int, turn: int = turn) -> None:
                async with sem:
                    res = await one(client, model, contexts[s], a.gen_tokens)
                results.append(res)
                if "ids" in res:
                    contexts[s] = contexts[s] + res["ids"] + user_turn(a, s, turn, vocab)

            await asyncio.gather(*(send(s) for s in order))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttfts = sorted(r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None)
    prompt, cached = sum(r["prompt"] for r in ok), sum(r["cached"] for r in ok)
    out_tokens = sum(r["completion"] for r in ok)
    return {
        "requests": len(results), "errors": [r["error"] for r in results if "error" in r][:5],
        "prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens_computed": prompt - cached,
        "ttft_ms": {"p50": pct(ttfts, 50), "p99": pct(ttfts, 99), "mean": statistics.fmean(ttfts) if ttfts else None},
        "output_tokens": out_tokens, "wall_s": wall, "output_tok_s": out_tokens / wall if wall else None,
        "working_set_tokens": len(system) + sum(len(c) - len(system) for c in contexts),  # system once
    }  # fmt: skip


def pct(xs: list[float], p: float) -> float | None:
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def tier_metrics(mesh: Mesh) -> dict[str, float]:
    workers = mesh.worker_ids(m.Role.PREFILL) + mesh.worker_ids(m.Role.DECODE)
    return {
        k: sum(metric_total(mesh.metrics_url(w), name) for w in workers) for k, name in TIER_METRICS.items()
    }


def run_config(a: argparse.Namespace, model: Path, tmp: Path, name: str) -> dict[str, Any]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    args = up_args(a, model, tmp / f"logs-{name.replace('+', '-')}", CONFIGS[name])
    t0, load_before = time.monotonic(), os.getloadavg()[0]
    mesh = start_mesh(args)
    try:
        started = time.monotonic() - t0
        res = asyncio.run(workload(a, mesh, min(vocab, 30000)))
        res["tiers"] = tier_metrics(mesh)
    finally:
        mesh.stop()
    load = {"load_average_1m_before": round(load_before, 2), "load_average_1m_after": round(os.getloadavg()[0], 2)}
    return {"up": "moemesh " + " ".join(args), "start_s": started, **load, **res}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kv-tiers-"))
    model = model_dir(a, tmp)
    workers = a.prefill_workers + a.decode_workers
    rec: dict[str, Any] = {
        "bench": "kv_tiers", **provenance(["python", "-m", "bench.kv_tiers", *(sys.argv[1:] if argv is None else argv)]),
        "device": a.device, "model": str(model),
        "workload": {k: getattr(a, k) for k in ("sessions", "turns", "system_len", "user_len", "gen_tokens",
                                                "concurrency", "page_size", "seed")},
        "pool": {"workers": workers, "device_pages_per_worker": a.num_pages, "host_pages_per_worker": a.host_kv_pages,
                 "device_tokens_total": workers * a.num_pages * a.page_size},
        "leaves_out": "model quality (random weights); sampling other than greedy; turns of one chat overlapping; "
        "the store's own memory (every worker lends kv_store_segment_mb); a mesh on one machine (loopback TCP)",
        "configs": {},
    }  # fmt: skip
    for name in a.configs.split(","):
        rec["configs"][name] = res = run_config(a, model, tmp, name)
        print(f"{name}: computed {res['prefill_tokens_computed']} of {res['prompt_tokens']} prompt tokens, "
              f"TTFT p50 {res['ttft_ms']['p50']:.1f} ms p99 {res['ttft_ms']['p99']:.1f} ms, "
              f"{res['output_tok_s']:.1f} output tok/s, tiers {res['tiers']}", flush=True)  # fmt: skip
    ws = max(r["working_set_tokens"] for r in rec["configs"].values())
    rec["pool"]["working_set_tokens"] = ws
    rec["pool"]["working_set_over_device_pool"] = ws / rec["pool"]["device_tokens_total"]
    out = (
        a.out
        or (os.environ.get("OUT", "") and f"{os.environ['OUT']}/kv_tiers-{a.device}.json")
        or (f"bench/results/kv_tiers-{a.device}.json")
    )
    write_json(out, rec)
    print(f"wrote {out}")
    return rec


if __name__ == "__main__":
    main()
