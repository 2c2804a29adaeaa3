"""Cache-aware vs load-only placement on a shared-prefix workload, through the embedded mesh.

    python -m bench.prefix_routing [--groups 16] [--prompts-per-group 4] [--system-len 2048]
        [--question-len 64] [--output-len 8] [--concurrency 4] [--prefix-weights 8,2] [--repeats 1]

For each placement mode the tiny model is served by a fresh mesh (nats-server, kv-broker, scheduler,
2 prefill workers, 1 decode worker, gateway; Mooncake TCP; every prompt disaggregated, so prefill
placement is what is measured) and sent the same shared-prefix workload (libs.loadgen.datasets: groups of
prompts sharing a random "system prompt", shuffled) at a fixed concurrency:
- cache-aware, once per `--prefix-weights` value: the scheduler's `prefix_weight` (a full prefix hit is
  worth that many queued requests), hits from the kv-broker's prefix index;
- load-only: `prefix_weight` 0, placement on load alone (each worker still has its own prefix cache).
Reported per mode: TTFT (median, mean, p90, p99), prompt tokens the prefill workers computed vs found
cached (their `moemesh_prefill_tokens_total{cached}`), KV bytes sent to the decode worker, and where
each group's prompts ran. Writes bench/results/prefix_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh, MeshConfig
from libs.loadgen.benchmark import LoadConfig, run_benchmark
from libs.loadgen.client import Endpoint
from libs.loadgen.datasets import BenchRequest, shared_prefix_requests
from libs.loadgen.report import write_json
from libs.tokenizer import Tokenizer
from proto import messages as m

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(url: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples (whose label set contains `labels`) at a Prometheus endpoint."""
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        mt = _SAMPLE.match(line)
        if mt and mt.group(1) == name and labels in (mt.group(2) or ""):
            total += float(mt.group(3))
    return total


def worker_counters(mesh: Mesh) -> dict[str, dict[str, float]]:
    out = {}
    for w in mesh.worker_ids(m.Role.PREFILL):
        url = mesh.metrics_url(w)
        out[w] = {
            "computed_tokens": scrape(url, "moemesh_prefill_tokens_total", 'cached="no"'),
            "cached_tokens": scrape(url, "moemesh_prefill_tokens_total", 'cached="yes"'),
            "kv_bytes_sent": scrape(url, "moemesh_kv_transfer_bytes_total"),
            "requests": scrape(url, "moemesh_prefill_requests_received_total"),
        }
    return out


def delta(after: dict, before: dict) -> dict:
    return {w: {k: after[w][k] - before[w][k] for k in after[w]} for w in after}


async def warm_up(ep: Endpoint, n: int, vocab: int) -> None:
    """Prompts unrelated to the workload, so first-use costs (allocation, Mooncake connections) are paid
    before timing, on both prefill workers."""
    reqs = [BenchRequest([(7 * i + j) % (vocab - 3) + 3 for j in range(64)], 64, 4) for i in range(n)]
    await run_benchmark(ep, reqs, LoadConfig(max_concurrency=n, warmup_requests=0, progress=False))


def run_mode(
    args: argparse.Namespace, model: Path, weight: float, reqs: list[BenchRequest], vocab: int
) -> dict:
    cfg = MeshConfig(
        model_dir=model, port=0, prefill_workers=2, decode_workers=1,
        extra_env={"services.scheduler": {
            "MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "0",
            "MOEMESH_SCHEDULER_PREFIX_WEIGHT": str(weight),
        }},
    )  # fmt: skip
    with Mesh(cfg) as mesh:
        ep = Endpoint(mesh.url, "openai", mesh.model_name)
        asyncio.run(warm_up(ep, 4, vocab))
        before = worker_counters(mesh)
        t0 = time.perf_counter()
        run = asyncio.run(
            run_benchmark(
                ep, reqs, LoadConfig(max_concurrency=args.concurrency, warmup_requests=0, progress=False)
            )
        )
        wall = time.perf_counter() - t0
        per_worker = delta(worker_counters(mesh), before)
        index_entries = scrape(mesh.metrics_url("kv-broker"), "moemesh_kv_broker_prefix_entries")
        queries_ok = scrape(
            mesh.metrics_url("scheduler"), "moemesh_scheduler_prefix_queries_total", 'outcome="ok"'
        )
    s = run.summary
    computed = sum(w["computed_tokens"] for w in per_worker.values())
    cached = sum(w["cached_tokens"] for w in per_worker.values())
    return {
        "prefix_weight": weight,
        "completed": s["completed"],
        "failed": s["failed"],
        "wall_s": round(wall, 2),
        "ttft_ms": {k: round(v, 1) for k, v in s["ttft_ms"].items() if k != "count"},
        "e2e_ms_median": round(s["e2e_ms"]["median"], 1),
        "request_throughput": round(s["request_throughput"], 2),
        "prefill_tokens_computed": int(computed),
        "prefill_tokens_cached": int(cached),
        "prefill_cache_hit_rate": round(cached / max(computed + cached, 1), 3),
        "kv_bytes_sent": int(sum(w["kv_bytes_sent"] for w in per_worker.values())),
        "per_prefill_worker": per_worker,
        "broker_index_entries": int(index_entries),
        "scheduler_prefix_queries_ok": int(queries_ok),
    }


def median_of(rows: list[dict]) -> dict:
    """Per-run headline numbers, their median over the runs."""
    keys = {
        "ttft_median_ms": lambda r: r["ttft_ms"]["median"], "ttft_mean_ms": lambda r: r["ttft_ms"]["mean"],
        "ttft_p90_ms": lambda r: r["ttft_ms"]["p90"], "request_throughput": lambda r: r["request_throughput"],
        "prefill_tokens_computed": lambda r: r["prefill_tokens_computed"],
        "prefill_cache_hit_rate": lambda r: r["prefill_cache_hit_rate"], "kv_bytes_sent": lambda r: r["kv_bytes_sent"],
    }  # fmt: skip
    return {k: statistics.median(f(r) for r in rows) for k, f in keys.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--prompts-per-group", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--prefix-weights", default="8,2", help="cache-aware modes' weights (the first is compared)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs of every mode; medians are compared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: a fresh tiny model)")
    ap.add_argument("--out", default="bench/results/prefix_routing.json")
    args = ap.parse_args()
    model = (
        Path(args.model)
        if args.model
        else write_tiny_model(Path("/tmp/moemesh-bench-prefix-tiny"), seed=0, overwrite=True)
    )
    tok = Tokenizer.from_pretrained(model)
    specials = {i for i in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) if i is not None}
    reqs = shared_prefix_requests(
        args.groups, args.prompts_per_group, args.system_len, args.question_len, args.output_len,
        vocab_size=tok.vocab_size, seed=args.seed, exclude_ids=specials,
    )  # fmt: skip
    results: dict = {
        "benchmark": "prefix_routing",
        "command": "python -m bench.prefix_routing " + " ".join(sys.argv[1:]),
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "load_avg_before": os.getloadavg()},
        "workload": {
            "dataset": "libs.loadgen.datasets.shared_prefix_requests (shuffled)",
            "groups": args.groups,
            "prompts_per_group": args.prompts_per_group,
            "system_len": args.system_len,
            "question_len": args.question_len,
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "prompt_tokens_total": sum(r.input_len for r in reqs),
            "seed": args.seed,
            "mesh": "tiny model, 2 prefill workers + 1 decode worker, direct prefill off, Mooncake TCP",
        },  # fmt: skip
        "modes": {},
    }
    weights = [float(w) for w in args.prefix_weights.split(",")]
    if not weights or any(not w > 0 for w in weights) or args.repeats < 1:
        raise SystemExit(
            f"--prefix-weights must be positive numbers (got {args.prefix_weights!r}), --repeats >= 1"
        )
    modes = [(f"cache_aware_w{w:g}", w) for w in weights] + [("load_only", 0.0)]
    runs: dict[str, list[dict]] = {name: [] for name, _ in modes}
    for rep in range(args.repeats):  # modes interleaved, so a change in machine load hits all of them
        for name, weight in modes:
            row = run_mode(args, model, weight, reqs, tok.vocab_size)
            runs[name].append(row)
            print(
                name, rep, json.dumps({k: v for k, v in row.items() if k != "per_prefill_worker"}), flush=True
            )
    for name, rows in runs.items():
        results["modes"][name] = {"median_of_runs": median_of(rows), "runs": rows}
    a, b = results["modes"][modes[0][0]]["median_of_runs"], results["modes"]["load_only"]["median_of_runs"]
    results["comparison"] = {
        "modes": f"{modes[0][0]} vs load_only (medians over {args.repeats} runs)",
        "ttft_median_speedup": round(b["ttft_median_ms"] / a["ttft_median_ms"], 2),
        "ttft_mean_speedup": round(b["ttft_mean_ms"] / a["ttft_mean_ms"], 2),
        "prefill_tokens_computed_ratio": round(
            a["prefill_tokens_computed"] / b["prefill_tokens_computed"], 3
        ),
    }
    results["machine"]["load_avg_after"] = os.getloadavg()
    print("comparison", json.dumps(results["comparison"]), flush=True)
    print(f"wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
