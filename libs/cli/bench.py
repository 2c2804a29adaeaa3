"""`moemesh bench --base-url URL`: SGLang bench_serving's flags against any OpenAI-compatible server: one
run, a concurrency sweep (`--sweep`) or the slow-down experiment (`--slowdown-ms`, `--release-at-batch`);
prints the summary, writes JSON (`--output-file`) and PNG plots (`--plot-dir`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, throughput; sweeps; slow-down)",
        description="Serving benchmark in the manner of SGLang's bench_serving. Requests stream with "
        "ignore_eos so output lengths hold; token counts come from the server's usage.",
    )
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    p.add_argument("--model", default="", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default="", help="sent as Authorization: Bearer KEY")
    p.add_argument("--dataset-name", default="random", choices=["random", "shared-prefix", "jsonl"])
    p.add_argument("--dataset-path", default="", help="JSONL file for --dataset-name jsonl")
    p.add_argument(
        "--tokenizer", default="", help="checkpoint folder: vocabulary for random ids, text for chat"
    )
    p.add_argument(
        "--random-vocab-size",
        type=int,
        default=0,
        help="ids drawn below this (default: tokenizer's, else 1000)",
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [L*ratio, L]")
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--extra-request-body", default="", help="JSON object merged into every request body")
    p.add_argument("--output-file", default="", help="write the results as JSON here")
    p.add_argument("--plot-dir", default="", help="write PNG plots here")
    p.add_argument("--sweep", default="", help="comma-separated concurrencies to run in turn, e.g. 1,8,32,64")
    p.add_argument(
        "--slowdown-ms", type=float, default=0.0, help="slow-down experiment: decode sleep per forward"
    )
    p.add_argument(
        "--release-at-batch", type=int, default=64, help="slow-down experiment: release at this batch"
    )
    _add_client_args(p)
    p.add_argument("--disable-progress", action="store_true")
    p.set_defaults(func=run)


def _add_client_args(p: argparse.ArgumentParser) -> None:
    """How the load is sent: which client, how many client processes, which event loop."""
    p.add_argument(
        "--client",
        default=None,
        choices=["raw", "httpx"],
        help="streaming client: raw (lean HTTP/1.1, a few us of CPU per streamed event; http:// only) or httpx "
        "(several times that; https://). Default: raw for http://, httpx for https://",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="split the requests over this many client processes, merged into one result; raise it when "
        "one process cannot keep up (tokens/s x CPU per token near one core), one per idle core at most",
    )
    p.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="the client processes' event loop (auto: uvloop where installed)",
    )


def _sweep(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--sweep needs concurrencies >= 1, got {text!r}")
    return values


def _tokenizer(path: str) -> Any:
    if not path:
        return None
    from libs.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(path)


def build_requests(args: argparse.Namespace) -> list:
    from libs.loadgen import datasets as ds

    tok = _tokenizer(args.tokenizer)
    vocab = args.random_vocab_size or (tok.vocab_size if tok is not None else 1000)
    specials = (
        {i for i in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) if i is not None} if tok else set()
    )
    if args.dataset_name == "random":
        reqs = ds.random_requests(
            args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
            vocab_size=vocab, seed=args.seed, exclude_ids=specials,
        )  # fmt: skip
    elif args.dataset_name == "shared-prefix":
        reqs = ds.shared_prefix_requests(
            args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len, args.gsp_question_len,
            args.gsp_output_len, vocab_size=vocab, seed=args.seed, exclude_ids=specials,
        )  # fmt: skip
    else:
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path")
        reqs = ds.load_jsonl(args.dataset_path, args.num_prompts, args.random_output_len, tok)
    return ds.to_text(reqs, tok) if args.backend == "openai-chat" else reqs


def _endpoint(args: argparse.Namespace) -> Any:
    from libs.loadgen.benchmark import http_client
    from libs.loadgen.client import Endpoint, first_model

    try:
        extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    except ValueError as e:
        raise ValueError(f"--extra-request-body is not valid JSON: {e}") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    ep = Endpoint(args.base_url, args.backend, args.model, args.api_key, extra)
    if not ep.model:

        async def fetch() -> str:
            async with http_client(1) as client:
                return await first_model(client, args.base_url, args.api_key)

        try:
            ep = Endpoint(args.base_url, args.backend, asyncio.run(fetch()), args.api_key, extra)
        except OSError as e:
            raise ValueError(f"cannot reach {args.base_url}: {e}") from None
    return ep


def _clients(args: argparse.Namespace) -> Any:
    from libs.bus.loop import loop_kind
    from libs.loadgen.benchmark import Clients

    clients = Clients(args.client, args.client_procs, args.event_loop)
    clients.resolve(args.base_url)  # a wrong pairing fails before anything is built or sent
    loop_kind(args.event_loop)
    return clients


def run(args: argparse.Namespace) -> int:
    from libs.loadgen.benchmark import LoadConfig

    if args.slowdown_ms < 0:
        raise ValueError(f"--slowdown-ms must be >= 0, got {args.slowdown_ms}")
    clients = _clients(args)
    requests = build_requests(args)
    ep = _endpoint(args)
    if args.slowdown_ms > 0:
        return _run_slowdown(args, ep, requests, clients)
    concurrencies: list[int | None] = list(_sweep(args.sweep)) if args.sweep else [args.max_concurrency]
    runs = []
    for i, c in enumerate(concurrencies):
        # Each run of a sweep gets prompts of its own (seed + i, same shapes), so that no run finds the
        # previous one's prompts in the server's prefix cache; a JSONL file's prompts serve every run.
        seed = args.seed + i
        if i:
            requests = build_requests(argparse.Namespace(**{**vars(args), "seed": seed}))
        load = LoadConfig(c, args.request_rate, args.warmup_requests, seed, not args.disable_progress)
        runs.append(_one_run(ep, requests, load, f"concurrency {c}" if args.sweep else "bench", clients))
    _write(args, runs, bool(args.sweep))
    return 0 if all(r.summary["completed"] for r in runs) else 1


def _one_run(ep: Any, requests: list, load: Any, label: str, clients: Any) -> Any:
    from libs.bus import loop
    from libs.loadgen.benchmark import run_benchmark
    from libs.loadgen.report import format_summary

    run = loop.run(run_benchmark(ep, requests, load, label, clients), clients.event_loop)
    print(format_summary(run.summary, f"Serving Benchmark Result ({label})"), flush=True)
    if run.summary["failed"]:
        first = next(r for r in run.records if not r.ok)
        print(f"warning: {run.summary['failed']} requests failed; first: {first.error}", file=sys.stderr)
    return run


def _write(args: argparse.Namespace, runs: list, sweep: bool) -> None:
    from libs.loadgen.report import provenance, write_json

    if args.output_file:
        data = {"sweep": [r.to_json() for r in runs]} if sweep else runs[0].to_json()
        print(f"results: {write_json(args.output_file, provenance() | data)}")
    if args.plot_dir:
        from libs.loadgen import plots  # matplotlib only when plotting (GPU bundles leave it out)

        d = Path(args.plot_dir)
        labels = [f"c={r.config['max_concurrency']}" for r in runs] if sweep else ["bench"]
        print(
            f"plot: {plots.latency_cdfs(list(zip(labels, [r.records for r in runs], strict=True)), d / 'latency_cdf.png')}"
        )
        if sweep:
            points = [(r.config["max_concurrency"], r.summary) for r in runs]
            title = f"{runs[0].config['model']} at {args.base_url}"
            print(f"plot: {plots.sweep(points, d / 'sweep.png', title)}")


def _run_slowdown(args: argparse.Namespace, ep: Any, requests: list, clients: Any) -> int:
    from libs.bus import loop
    from libs.loadgen import slowdown
    from libs.loadgen.report import provenance, write_json

    cfg = slowdown.SlowdownConfig(args.slowdown_ms, args.release_at_batch)
    # SIGTERM unwinds like Ctrl-C, so the experiment's `finally` turns the server's slow-down off.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # The slowed run gets other prompts of the same shape (the next seed), so that it does not find the
    # baseline's prompts in the prefix cache; a JSONL file's prompts serve both runs.
    other = build_requests(argparse.Namespace(**{**vars(args), "seed": args.seed + 1}))
    result = loop.run(slowdown.slowdown_experiment(ep, requests, other, cfg, clients), clients.event_loop)
    print(format_slowdown(result), flush=True)
    if args.output_file:
        print(f"results: {write_json(args.output_file, provenance() | slowdown.to_json(result))}")
    if args.plot_dir:
        from libs.loadgen import plots

        runs = [
            {**result["baseline"], "label": "without slow-down", "release_s": None},
            {**result["slowdown"], "label": f"slow-down {args.slowdown_ms:g} ms, released at batch "
             f"{result['slowdown']['batch_at_release']} ({result['slowdown']['release_reason']})"},
        ]  # fmt: skip
        print(f"plot: {plots.slowdown(runs, Path(args.plot_dir) / 'slowdown.png')}")
    return 0 if result["full_batch_decode_tokens_per_s"] else 1


def format_slowdown(result: dict) -> str:
    b, s = result["baseline"], result["slowdown"]

    def rate(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f}"

    lines = [
        f"requests {result['config']['num_prompts']}, slow-down {result['config']['slowdown_ms']:g} ms, "
        f"release at batch {result['config']['release_at_batch']}",
        f"without slow-down: peak decode batch {b['peak_batch']}, "
        f"{rate(b['decode_phase']['tokens_per_s'])} tok/s from first to last token "
        f"({b['summary']['output_throughput']:.1f} over the whole run)",
        f"with slow-down:    batch {s['batch_at_release']} at release ({s['release_reason']}), "
        f"{s['finished_before_release']} finished before it",
        f"decode tokens/s at full batch: {rate(result['full_batch_decode_tokens_per_s'])} "
        f"(window {s['full_batch'].get('window_s', 0):.2f} s while {s['full_batch'].get('batch_from', 0)}"
        f"..{s['full_batch'].get('batch_to', 0)} requests ran, "
        f"median ITL {s['full_batch'].get('itl_ms', {}).get('median', 0):.1f} ms)",
        f"ratio to the run without slow-down: {rate(result['ratio'])}",
    ]
    bar = "=" * 60
    return "\n".join([bar, f"{'Slow-down experiment':^60}", bar, *lines, bar])
