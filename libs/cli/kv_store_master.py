"""`moemesh kv-store-master [--host H] [--port P]`: run the Mooncake Store master of the shared KV tier in
the foreground (exec'd: signals reach it), as compose and Kubernetes run it; `moemesh up --kv-store` starts
its own (libs.launch.mooncake_master)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "kv-store-master",
        help="run the Mooncake Store master the workers' shared KV tier (kv_store_master) points at",
        description="Execs the mooncake_master binary of the installed Mooncake wheel with its RPC service on "
        "HOST:PORT and its metrics and admin HTTP (/metrics) on HOST:METRICS_PORT. Workers join it with "
        "kv_store_master=HOST:PORT and a host tier (host_kv_pages or host_kv_cache_gb).",
    )
    p.add_argument("--host", default="0.0.0.0", help="address the master listens on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=50051, help="its RPC port (default 50051, Mooncake's own)")
    p.add_argument("--metrics-port", type=int, default=9003, help="its metrics and admin HTTP port (default 9003)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from libs.launch.mooncake_master import argv

    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    cmd = argv(args.host, args.port, args.metrics_port)
    os.execv(cmd[0], cmd)
    return 0  # not reached
