"""Network partitions on the CPU mesh (tiny model), every service a host of its own: a Linux network
namespace on one bridge (libs.chaos.netns; needs root). Under steady streaming traffic each partition cuts
two hosts apart for --cut-seconds, then heals:

    python -m bench.partitions [--cut-seconds 10] [--clients 8] [--partitions decode-nats,...]

(a) a decode worker from NATS, (b) a prefill worker from the decode worker's Mooncake ports with the bus
intact, (c) the gateway from NATS, (d) the kv-broker from NATS. Per partition: requests that ended from the
cut on, by how they ended (ok = the in-process Engine's greedy text; retryable = 429/503/504 or the
connection; error; hung past the client deadline; wrong), the ok rate before and during the cut, seconds
from the heal until the rate is back to 80% of before, request pages and live requests left on the workers
and live KV handles at the kv-broker once traffic stopped. JSON to bench/results/partitions.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

from bench.chaos import reference
from libs.chaos.netns import Network, unavailable
from libs.chaos.partitions import HOSTS, STANDARD, partition_config, run_partition
from libs.chaos.scenarios import chaos_prompts
from libs.chaos.traffic import Traffic
from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh
from libs.loadgen.report import write_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cut-seconds", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=8, help="streams open at all times")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--deadline", type=float, default=30.0, help="the gateway's request deadline (s)")
    p.add_argument("--window", type=float, default=4.0, help="seconds of the rate windows")
    p.add_argument("--recover-timeout", type=float, default=60.0)
    p.add_argument("--partitions", default="", help="comma-separated names (default: all)")
    p.add_argument("--out", default="bench/results/partitions.json")
    args = p.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    chosen = [x for x in STANDARD if not args.partitions or x.name in args.partitions.split(",")]
    model = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny-v3", seed=0)
    prompts = chaos_prompts(16)
    want = reference(model, prompts, args.max_tokens)
    lease_ms = 4000
    result: dict = {
        "command": shlex.join(["python", "-m", "bench.partitions", *(sys.argv[1:] if argv is None else argv)]),
        "environment": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "mesh": "2 prefill + 2 decode workers, a scheduler, the kv-broker, the gateway, nats (user/password), "
        "each in its own network namespace on one bridge; tiny model on CPU; lease 4 s; "
        f"gateway request deadline {args.deadline:.0f} s; every service supervised by the launcher",
        "traffic": f"{args.clients} clients streaming back to back, greedy, {args.max_tokens} tokens, 16 prompts "
        "of 6-45 tokens (short ones prefilled on the decode worker, long ones through a prefill worker and Mooncake)",
        "leaves_out": "partial (one-way) loss, latency and reordering; partitions of the launcher's own host",
        "partitions": [],
    }  # fmt: skip
    with Network(HOSTS) as net:
        cfg = partition_config(
            model, None, net, password=os.urandom(8).hex(), lease_ms=lease_ms, deadline_s=args.deadline
        )
        with Mesh(cfg) as mesh:
            print(f"mesh up ({mesh.url}); logs in {mesh.log_dir}", flush=True)
            for part in chosen:
                traffic = Traffic(
                    mesh.url, mesh.model_name, prompts, want, args.max_tokens, args.deadline + 15
                )
                row = asyncio.run(
                    run_partition(
                        mesh, net, part, traffic, clients=args.clients, window_s=args.window,
                        cut_s=args.cut_seconds, recover_timeout_s=args.recover_timeout,
                        leak_timeout_s=lease_ms / 1000 + 80,  # the decode side's write fence: 60 s
                    )
                )  # fmt: skip
                result["partitions"].append(row.as_dict())
                print(json.dumps(row.as_dict()), flush=True)
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
