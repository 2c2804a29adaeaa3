"""`moemesh serve SERVICE [flags]`: run one service as a container's main process (compose, Kubernetes).

It is `python -m services.<service> [flags]` (the process is replaced, so SIGTERM reaches the service's
graceful drain directly) with two defaults a container needs and a plain process does not:
- `MOEMESH_<SERVICE>_INSTANCE_ID` from the hostname: unique per container, and stable across restarts
  where the orchestrator keeps the name (a StatefulSet pod `decode-worker-0`), so a restarted worker
  re-registers under the same id at the kv-broker and the scheduler;
- for workers, `MOEMESH_<SERVICE>_TRANSFER_HOSTNAME` from the address the hostname resolves to (the
  container's own IP), which peers' Mooncake engines can reach, instead of 127.0.0.1.
Values already in the environment win.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from collections.abc import Mapping
from typing import Any

from libs.bus.settings import env_prefix

# service name (as in `service.name` and the compose/Kubernetes names) -> module under services/
SERVICES: dict[str, str] = {
    "gateway": "services.gateway",
    "scheduler": "services.scheduler",
    "kv-broker": "services.kv_broker",
    "prefill-worker": "services.prefill_worker",
    "decode-worker": "services.decode_worker",
}
WORKERS = ("prefill-worker", "decode-worker")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run one service in the foreground (the entry point of its container)",
        description="Runs `python -m services.<SERVICE>`, with the instance id taken from the hostname and, "
        "for workers, the KV transfer address from the host's IP, unless set in the environment. Flags after "
        "SERVICE are the service's own (`--model-dir DIR` ...).",
    )
    p.add_argument("service", choices=sorted(SERVICES), help="which service")
    p.add_argument(
        "--dry-run", action="store_true", help="print the command and the settings added; run nothing"
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="the service's own flags")
    p.set_defaults(func=run)


def instance_id_of(hostname: str) -> str:
    """A hostname as a NATS subject token (ids sit in subjects): anything but [A-Za-z0-9_-] becomes '-'."""
    token = re.sub(r"[^A-Za-z0-9_-]", "-", hostname.strip())
    if not token.strip("-"):
        raise ValueError(f"hostname {hostname!r} gives no usable instance id")
    return token


def container_env(service: str, env: Mapping[str, str], hostname: str, address: str | None) -> dict[str, str]:
    """The settings `serve` adds for `service` (nothing the environment already sets)."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; one of {', '.join(sorted(SERVICES))}")
    prefix = env_prefix(service)
    added: dict[str, str] = {}
    if not env.get(prefix + "INSTANCE_ID"):
        added[prefix + "INSTANCE_ID"] = instance_id_of(hostname)
    if service in WORKERS and not env.get(prefix + "TRANSFER_HOSTNAME") and address:
        added[prefix + "TRANSFER_HOSTNAME"] = address
    return added


def _address(hostname: str) -> str | None:
    try:
        return socket.gethostbyname(hostname)
    except OSError:
        return None


def run(args: argparse.Namespace) -> int:
    hostname = socket.gethostname()
    added = container_env(args.service, os.environ, hostname, _address(hostname))
    argv = [sys.executable, "-m", SERVICES[args.service], *[a for a in args.args if a != "--"]]
    if args.dry_run:
        for k, v in added.items():
            print(f"{k}={v}")
        print(" ".join(argv))
        return 0
    os.execvpe(argv[0], argv, {**os.environ, **added})
    return 0  # not reached
