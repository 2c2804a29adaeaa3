"""Batched vs one-at-a-time prefill through the mesh: 64 concurrent prompts, max_tokens 1, `moemesh bench`
against a fresh `moemesh up` (tiny model, CPU) per mode and round, modes alternated so load drifts hit both.

    python -m bench.prefill_batching [--lengths 64,300,2000] [--rounds 2] [--max-prefill-tokens 2048]

"single" runs the prefill worker with `max_prefill_prompts=1` (one prompt per forward, the worker before
batching); "batched" with no limit (every prompt that arrived joins the next forward, up to
`max_prefill_tokens`). Both use the same token budget and the prefill worker's default attention backend,
and every prompt goes through the prefill worker (the scheduler's direct-prefill threshold is 0). The
record has each run's duration, TTFT and the prefill worker's forwards (from its /metrics, the 2 warm-up
requests included), and per length the speedup: median single duration over median batched duration.
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

MOEMESH = str(Path(sys.executable).with_name("moemesh"))


def start_mesh(mode: str, budget: int, log_dir: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "MOEMESH_PREFILL_WORKER_MAX_PREFILL_TOKENS": str(budget)}
    env["MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD"] = "0"  # every prompt through the prefill worker
    # 64 x 2,000 tokens take longer than the default 30 s KV lease on a small CPU either way; an expired
    # lease fails the request over (re-submit), which only adds work
    env["MOEMESH_SCHEDULER_LEASE_MS"] = "300000"
    env["MOEMESH_PREFILL_WORKER_MAX_PREFILL_PROMPTS"] = "1" if mode == "single" else "0"
    out = log_dir / "up.log"
    proc = subprocess.Popen(
        [MOEMESH, "up", "--port", "0", "--log-dir", str(log_dir)],
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
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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
    ap.add_argument("--output", default="bench/results/prefill_batching.json")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    runs = []
    with tempfile.TemporaryDirectory(prefix="prefill-batching-") as tmp:
        for rnd in range(a.rounds):
            for mode in ("single", "batched") if rnd % 2 == 0 else ("batched", "single"):
                log_dir = Path(tmp) / f"{mode}-{rnd}"
                log_dir.mkdir()
                proc, url = start_mesh(mode, a.max_prefill_tokens, log_dir)
                try:
                    for length in lengths:
                        before = prefill_forwards(log_dir)
                        res = bench(url, length, a.prompts, 100 * rnd + length, log_dir / f"{length}.json")
                        s = res["summary"]
                        runs.append({
                            "mode": mode, "round": rnd, "prompt_len": length, "completed": s["completed"],
                            "failed": s["failed"], "duration_s": s["duration_s"],
                            "input_tokens_per_s": s["input_throughput"], "ttft_ms": s["ttft_ms"],
                            "prefill_forwards": prefill_forwards(log_dir) - before,
                            "load_average": res["environment"]["load_average_1m_5m_15m"],
                        })  # fmt: skip
                        print(f"{mode} round {rnd} {length} tokens: {s['duration_s']:.2f} s", flush=True)
                finally:
                    stop_mesh(proc)
    speedup = {}
    for length in lengths:
        med = {
            mode: statistics.median(
                r["duration_s"] for r in runs if (r["mode"], r["prompt_len"]) == (mode, length)
            )
            for mode in ("single", "batched")
        }
        speedup[str(length)] = {"single_s": med["single"], "batched_s": med["batched"],
                                "speedup": med["single"] / med["batched"]}  # fmt: skip
    record = {
        "benchmark": "prefill_batching", "path": "mesh",
        "command": "python -m bench.prefill_batching " + " ".join(sys.argv[1:]),
        "settings": {"prompts": a.prompts, "lengths": lengths, "rounds": a.rounds,
                     "max_prefill_tokens": a.max_prefill_tokens, "max_tokens": 1,
                     "model": "tiny-v3 (moemesh up default), float32, CPU, torch_threads 1 per worker"},
        "environment": {"cpus": os.cpu_count()},
        "speedup_by_prompt_len": speedup,
        "runs": runs,
    }  # fmt: skip
    Path(a.output).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(speedup, indent=1))
    print("wrote", a.output)


if __name__ == "__main__":
    main()
