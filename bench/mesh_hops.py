"""Where a request's time to first token goes, hop by hop, from the mesh's own OpenTelemetry spans.

    python -m bench.mesh_hops [--requests 40] [--prompt-len 40] [--direct-threshold 16]
                              [--scheduler process|embedded]

Starts the embedded mesh on the tiny model with every service exporting spans over OTLP/HTTP to a
collector in this process, sends sequential streaming completions (max_tokens=1), and reports per span
(and span event) the median start offset from the gateway's root span and the median duration. The gaps
between one hop's end and the next one's start are the bus and process hand-offs.
Writes bench/results/mesh_hops.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.mesh_ttft import prompt_of, ttft_body
from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh, MeshConfig
from libs.loadgen.report import write_json
from libs.telemetry.collector import Collector

WARMUP = 5


def run(args: argparse.Namespace, collector: Collector) -> list[float]:
    model = write_tiny_model(Path("/tmp/moemesh-bench-hops"), overwrite=True)
    env = {"services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(args.direct_threshold)}}
    ttft = []
    cfg = MeshConfig(model_dir=model, port=0, extra_env=env, embedded_scheduler=args.scheduler == "embedded")
    with Mesh(cfg) as mesh, httpx.Client(timeout=30) as h:
        for i in range(args.requests + WARMUP):
            body = ttft_body(mesh.model_name, prompt_of(args.prompt_len, i))
            t0, first = time.perf_counter(), None
            with h.stream("POST", f"{mesh.url}/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if first is None and '"text"' in line:
                        first = (time.perf_counter() - t0) * 1e3
            if i >= WARMUP and first is not None:
                ttft.append(first)
        deadline = time.monotonic() + 10  # spans are exported in batches; wait for every trace's root
        while (
            len({s.trace_id for _, s in collector.spans}) < args.requests + WARMUP
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
    return ttft


def hops(collector: Collector) -> list[dict]:
    by_trace = collections.defaultdict(list)
    for svc, s in collector.spans:
        by_trace[s.trace_id].append((svc, s))
    rows = collections.defaultdict(list)
    traces = sorted(by_trace.values(), key=lambda sp: min(s.start_time_unix_nano for _, s in sp))[WARMUP:]
    for spans in traces:
        t0 = min(s.start_time_unix_nano for _, s in spans)
        for svc, s in spans:
            rows[(svc, s.name)].append(
                ((s.start_time_unix_nano - t0) / 1e6, (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6)
            )
            for e in s.events:
                rows[(svc, f"{s.name}:{e.name}")].append(((e.time_unix_nano - t0) / 1e6, 0.0))
    out = [
        {"service": k[0], "span": k[1], "start_ms": statistics.median(x[0] for x in v),
         "duration_ms": statistics.median(x[1] for x in v), "n": len(v)}
        for k, v in rows.items()
    ]  # fmt: skip
    return sorted(out, key=lambda r: r["start_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--direct-threshold", type=int, default=16)
    ap.add_argument("--scheduler", choices=("process", "embedded"), default="process")
    ap.add_argument("--out", default="bench/results/mesh_hops.json")
    args = ap.parse_args()
    collector = Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                       "OTEL_BSP_SCHEDULE_DELAY": "200"})  # fmt: skip
    ttft = run(args, collector)
    rows = hops(collector)
    for r in rows:
        print(
            f"{r['service']:16} {r['span']:34} start {r['start_ms']:7.2f} ms  dur {r['duration_ms']:7.2f} ms"
        )
    print(f"client TTFT p50 {statistics.median(ttft):.2f} ms over {len(ttft)} requests")
    result = {"benchmark": "mesh_hops", "prompt_len": args.prompt_len, "scheduler": args.scheduler,
              "requests": len(ttft),
              "client_ttft_p50_ms": statistics.median(ttft), "load_avg": os.getloadavg(), "hops": rows,
              "command": shlex.join(["python", "-m", "bench.mesh_hops", *sys.argv[1:]])}  # fmt: skip
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
