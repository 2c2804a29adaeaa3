"""`moemesh serve SERVICE [flags]`: run one service as a container's main process (compose, Kubernetes):
`python -m services.<service>` in place of this process, with the instance id (and a worker's transfer
hostname) from the container's hostname where neither the environment nor the config file sets them."""

# exec, so SIGTERM reaches the service's graceful drain directly. The hostname is stable across restarts
# where the orchestrator keeps the name (a StatefulSet pod decode-worker-0): a restarted worker re-registers
# under the same id. The address it resolves to is the container's own IP, which peers' Mooncake engines
# can reach, unlike 127.0.0.1.

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from libs.bus.settings import CONFIG_ENV, env_prefix, read_config

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
        "SERVICE are the service's own (`--model-dir DIR`, `--config FILE` ...; docs/configuration.md).",
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


def container_env(
    service: str, env: Mapping[str, str], hostname: str, address: str | None, in_file: Collection[str] = ()
) -> dict[str, str]:
    """The settings `serve` adds for `service`: nothing the environment or the config file (`in_file`: the
    keys of the service's section) already sets."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; one of {', '.join(sorted(SERVICES))}")
    prefix = env_prefix(service)
    added: dict[str, str] = {}
    if not env.get(prefix + "INSTANCE_ID") and "instance_id" not in in_file:
        added[prefix + "INSTANCE_ID"] = instance_id_of(hostname)
    wants_address = service in WORKERS and "transfer_hostname" not in in_file
    if wants_address and not env.get(prefix + "TRANSFER_HOSTNAME") and address:
        added[prefix + "TRANSFER_HOSTNAME"] = address
    return added


def config_file(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The config file the service will read: its last `--config FILE` flag, else $MOEMESH_CONFIG."""
    path = env.get(CONFIG_ENV, "")
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.removeprefix("--config=")
    return path


def section_keys(service: str, path: str) -> set[str]:
    """The keys of `service`'s section in the config file at `path` (none without a file)."""
    return set(read_config(path).get(service) or {}) if path else set()


def _address(hostname: str) -> str | None:
    try:
        return socket.gethostbyname(hostname)
    except OSError:
        return None


def run(args: argparse.Namespace) -> int:
    hostname = socket.gethostname()
    flags = [a for a in args.args if a != "--"]
    in_file = section_keys(args.service, config_file(flags, os.environ))
    added = container_env(args.service, os.environ, hostname, _address(hostname), in_file)
    argv = [sys.executable, "-m", SERVICES[args.service], *flags]
    if args.dry_run:
        for k, v in added.items():
            print(f"{k}={v}")
        print(" ".join(argv))
        return 0
    os.execvpe(argv[0], argv, {**os.environ, **added})
    return 0  # not reached
