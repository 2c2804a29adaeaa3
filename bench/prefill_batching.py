"""Batched vs one-at-a-time prefill through the mesh: 64 concurrent prompts, max_tokens 1, `moemesh bench`
against a fresh `moemesh up` (tiny model, CPU) per mode and round, modes alternated so load drifts hit both.

    python -m bench.prefill_batching [--lengths 64,300,2000] [--rounds 2] [--max-prefill-tokens 2048]
        [--engine-prompts 16]

"single" runs the prefill worker with `max_prefill_prompts=1` (one prompt per forward, the worker before
batching); "batched" with no limit (every prompt that arrived joins the next forward, up to
`max_prefill_tokens`). Both use the same token budget and the prefill worker's default attention backend,
and every prompt goes through the prefill worker (the scheduler's direct-prefill threshold is 0). The
record has each run's duration, TTFT, the prefill worker's forwards (from its /metrics, the 2 warm-up
requests included) and CPU seconds (from /proc), and per length the speedup: median single duration over
median batched duration, beside the same ratio of the prefill worker's CPU seconds.

The batching factor it is held to is measured first, with the mesh down: the same Engine settings in this
process (one torch thread, as a worker has), `--engine-prompts` prompts of each length prefilled one at a
time (`Engine.prefill`) and then all queued at once (`add_prefill` + `step`), in wall and thread-CPU
seconds. CPU seconds are what stays comparable on a shared, loaded machine; wall seconds are what a client
sees.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from libs.launch.supervisor import stop_group

MOEMESH = str(Path(sys.executable).with_name("moemesh"))
TINY = Path.home() / ".cache/moemesh/tiny-v3"  # what `moemesh up` serves by default
_TICK = os.sysconf("SC_CLK_TCK")


def prefill_worker_cpu_s(parent: int) -> float:
    """User + system CPU seconds of the prefill worker that `moemesh up` (pid `parent`) started."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if b"services.prefill_worker" in cmdline and int(stat[1]) == parent:
            return (int(stat[11]) + int(stat[12])) / _TICK
    raise RuntimeError(f"no prefill worker process under pid {parent}")


def engine_factor(length: int, prompts: int, budget: int) -> dict:
    """The batching factor of the Engine itself: one prompt at a time vs all queued, wall and CPU."""
    import random

    import torch

    from libs.engine import Engine, SamplingParams

    torch.set_num_threads(1)  # a worker's torch_threads default
    params = SamplingParams(max_tokens=1, temperature=0.0)
    # no prefix cache: released pages go back to the free list, so both modes reuse pages the warm-up
    # touched (fresh pool pages cost page faults, which would be charged to whichever mode ran first)
    engine = Engine.from_pretrained(
        TINY, max_prefill_tokens=budget, attention_backend="triton", enable_prefix_cache=False
    )
    rng = random.Random(length)
    batch = [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(2 * prompts)]
    for i, p in enumerate(batch[:4]):  # warm-up: as many pages in flight as the batched mode holds
        engine.add_prefill(f"warm-up-{i}", p, params)
    while engine.has_unfinished():
        for out in engine.step():
            engine.release(out.rid)
    t0, c0 = time.perf_counter(), time.thread_time()
    for i, p in enumerate(batch[:prompts]):
        engine.prefill(f"single-{i}", p, params)
        engine.release(f"single-{i}")
    single = (time.perf_counter() - t0, time.thread_time() - c0)
    t0, c0, steps = time.perf_counter(), time.thread_time(), 0
    for i, p in enumerate(batch[prompts:]):  # other prompts: no prefix-cache hits on the first half
        engine.add_prefill(f"batched-{i}", p, params)
    while engine.has_unfinished():
        for out in engine.step():
            engine.release(out.rid)
        steps += 1
    batched = (time.perf_counter() - t0, time.thread_time() - c0)
    return {
        "prompts": prompts, "prompt_len": length, "max_prefill_tokens": budget, "batched_forwards": steps,
        "single_wall_s": single[0], "batched_wall_s": batched[0], "factor_wall": single[0] / batched[0],
        "single_cpu_s": single[1], "batched_cpu_s": batched[1], "factor_cpu": single[1] / batched[1],
        "load_average": list(os.getloadavg()),
    }  # fmt: skip


def start_mesh(mode: str, budget: int, log_dir: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "MOEMESH_PREFILL_WORKER_MAX_PREFILL_TOKENS": str(budget)}
    env["MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD"] = "0"  # every prompt through the prefill worker
    # 64 x 2,000 tokens take longer than the default 30 s KV lease on a small CPU either way; an expired
    # lease fails the request over (re-submit), which only adds work
    env["MOEMESH_SCHEDULER_LEASE_MS"] = "300000"
    env["MOEMESH_PREFILL_WORKER_MAX_PREFILL_PROMPTS"] = "1" if mode == "single" else "0"
    out = log_dir / "up.log"
    proc = subprocess.Popen(
        [MOEMESH, "up", "--model", "tiny", "--port", "0", "--log-dir", str(log_dir)],
        env=env, stdout=out.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if (m := re.search(r"moemesh is up: (http://[\d.]+:\d+)", out.read_text())) is not None:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop_mesh(proc)
    raise RuntimeError(f"moemesh up did not come up: {out.read_text()[-2000:]}")


def stop_mesh(proc: subprocess.Popen) -> None:
    stop_group(proc, signal.SIGINT, 60)  # `moemesh up` drains and stops every service


def prefill_forwards(log_dir: Path) -> float:
    port = json.loads((log_dir / "ports" / "prefill-0.json").read_text())["http"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(r"^moemesh_prefill_forwards_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def bench(url: str, length: int, prompts: int, seed: int, out: Path) -> dict:
    cmd = [
        MOEMESH, "bench", "--base-url", url, "--num-prompts", str(prompts), "--random-input-len", str(length),
        "--random-output-len", "1", "--random-range-ratio", "1", "--max-concurrency", str(prompts),
        "--seed", str(seed), "--warmup-requests", "2", "--tokenizer",
        str(Path.home() / ".cache/moemesh/tiny-v3"), "--disable-progress", "--output-file", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,300,2000")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--engine-prompts", type=int, default=16, help="prompts per mode of the engine factor")
    ap.add_argument("--output", default="bench/results/prefill_batching.json")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    runs = []
    factors = {}
    for length in lengths:
        factors[str(length)] = engine_factor(length, a.engine_prompts, a.max_prefill_tokens)
        print(f"engine factor at {length} tokens: {factors[str(length)]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="prefill-batching-") as tmp:
        for rnd in range(a.rounds):
            for mode in ("single", "batched") if rnd % 2 == 0 else ("batched", "single"):
                log_dir = Path(tmp) / f"{mode}-{rnd}"
                log_dir.mkdir()
                proc, url = start_mesh(mode, a.max_prefill_tokens, log_dir)
                try:
                    for length in lengths:
                        before, cpu0 = prefill_forwards(log_dir), prefill_worker_cpu_s(proc.pid)
                        res = bench(url, length, a.prompts, 100 * rnd + length, log_dir / f"{length}.json")
                        s = res["summary"]
                        runs.append({
                            "mode": mode, "round": rnd, "prompt_len": length, "completed": s["completed"],
                            "failed": s["failed"], "duration_s": s["duration_s"],
                            "input_tokens_per_s": s["input_throughput"], "ttft_ms": s["ttft_ms"],
                            "prefill_forwards": prefill_forwards(log_dir) - before,
                            "prefill_worker_cpu_s": prefill_worker_cpu_s(proc.pid) - cpu0,
                            "load_average": res["environment"]["load_average_1m_5m_15m"],
                        })  # fmt: skip
                        print(f"{mode} round {rnd} {length} tokens: {s['duration_s']:.2f} s", flush=True)
                finally:
                    stop_mesh(proc)
    speedup = {}
    for length in lengths:
        med, cpu = ({
            mode: statistics.median(r[key] for r in runs if (r["mode"], r["prompt_len"]) == (mode, length))
            for mode in ("single", "batched")
        } for key in ("duration_s", "prefill_worker_cpu_s"))  # fmt: skip
        engine = factors[str(length)]
        speedup[str(length)] = {"single_s": med["single"], "batched_s": med["batched"],
                                "speedup": med["single"] / med["batched"],
                                "prefill_cpu_factor": cpu["single"] / cpu["batched"],
                                "engine_factor_wall": engine["factor_wall"],
                                "engine_factor_cpu": engine["factor_cpu"]}  # fmt: skip
    record = {
        "benchmark": "prefill_batching", "path": "mesh",
        "command": "python -m bench.prefill_batching " + " ".join(sys.argv[1:]),
        "settings": {"prompts": a.prompts, "lengths": lengths, "rounds": a.rounds,
                     "max_prefill_tokens": a.max_prefill_tokens, "max_tokens": 1,
                     "model": "tiny-v3 (moemesh up default), float32, CPU, torch_threads 1 per worker"},
        "environment": {"cpus": os.cpu_count(), "shared": "other engineers' jobs ran on the same cores; "
                        "see each run's load_average"},
        "speedup_by_prompt_len": speedup,
        "engine_factor": factors,
        "runs": runs,
    }  # fmt: skip
    Path(a.output).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(speedup, indent=1))
    print("wrote", a.output)


if __name__ == "__main__":
    main()
