"""The scheduler policy's CPU cost per placement, in process: one `WorkerTable.live` and one
`failover.place` (the policy over every worker, prefix hits on) for a table of simulated heartbeats.

    python -m bench.placement_cost [--decode 48 --prefill 8] [--n 20000]

Prints microseconds per call (the best of 8 repeats: the box is shared). The scheduler runs `live` three
times and `place` twice per request (admission check on submit, then the placement pass).
"""

from __future__ import annotations

import argparse
import json
import timeit

from proto.messages import Role, WorkerHeartbeat
from services.scheduler.failover import place
from services.scheduler.policy import PlacementRequest, PolicyConfig, WorkerTable


def heartbeat(wid: str, role: Role, running: int) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=wid, role=role, model="tiny", running=running, waiting=0, free_pages=16384,
        total_pages=16384, page_size=16, max_context=4096, interval_ms=250, sent_ms=0,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    table = WorkerTable()
    for i in range(args.decode):
        table.observe(heartbeat(f"decode-{i}", Role.DECODE, i % 7), 0.0)
    for i in range(args.prefill):
        table.observe(heartbeat(f"prefill-{i}", Role.PREFILL, i % 3), 0.0)
    req, cfg = PlacementRequest("r", "tiny", 256, 1), PolicyConfig()
    hits = {f"decode-{i}": 128 for i in range(0, args.decode, 5)}  # a shared prefix on some workers
    live = table.live(0.0)
    n = args.n // 4

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=n, repeat=8)) / n * 1e6

    out = {"workers": len(live), "live_us": best(lambda: table.live(0.0)),
           "place_us": best(lambda: place(live, req, cfg, hits, (), 8)),
           "decision": repr(place(live, req, cfg, hits, (), 8))}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
