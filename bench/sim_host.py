"""Many timing-model workers in one process, for bench/mesh_scale.py: each is the real PrefillWorker or
DecodeWorker service (own NATS connection, engine thread, KV pool, heartbeats, KV events) with
engine=sim and the skip transport; they share one event loop and one torch import, so 56 of them fit a
small machine.

    python -m bench.sim_host --decode decode-0,decode-1 --prefill prefill-0 --settings '{"model_dir": ...}'

MOEMESH_NATS_URL names the server. `--settings` is a JSON object of WorkerSettings fields every worker
gets (engine and transfer_protocol default to sim and skip). SIGTERM/SIGINT drains every worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from libs.bus.loop import run as run_loop
from services.decode_worker.service import DecodeWorker, DecodeWorkerSettings
from services.prefill_worker.service import PrefillWorker, PrefillWorkerSettings


def make_workers(decode: list[str], prefill: list[str], fields: dict) -> list:
    common = {"engine": "sim", "transfer_protocol": "skip", "http_port": 0, **fields}
    common.setdefault("nats_url", os.environ.get("MOEMESH_NATS_URL", "nats://127.0.0.1:4222"))
    out: list = [DecodeWorker(DecodeWorkerSettings(**common, instance_id=w)) for w in decode]
    out += [PrefillWorker(PrefillWorkerSettings(**common, instance_id=w)) for w in prefill]
    return out


async def run(workers: list) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(w.run(install_signals=False)) for w in workers]
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if t is not waiter and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    for w in workers:
        w.request_stop()
    await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", default="", help="comma-separated decode worker ids")
    ap.add_argument("--prefill", default="", help="comma-separated prefill worker ids")
    ap.add_argument("--settings", default="{}", help="JSON object of WorkerSettings fields")
    args = ap.parse_args()
    logging.basicConfig(level=os.environ.get("MOEMESH_LOG_LEVEL", "WARNING"))
    # many engine threads share this process's GIL with the event loop: hand it over more often than
    # every 5 ms, or heartbeats fall behind and the workers look dead
    sys.setswitchinterval(0.0005)
    ids = [[w for w in s.split(",") if w] for s in (args.decode, args.prefill)]
    loop = json.loads(args.settings).get("event_loop", "asyncio")
    run_loop(run(make_workers(ids[0], ids[1], json.loads(args.settings))), loop)


if __name__ == "__main__":
    main()
