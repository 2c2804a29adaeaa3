"""Ports files: a service that bound port 0 writes the ports it got (JSON, name -> port), so whoever started it
learns them with no pick-then-bind race (as nats-server's `--ports_file_dir`). Written whole (a temporary file
renamed over it): a reader sees either nothing or every port."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path


def write_ports(path: str | Path, ports: Mapping[str, int]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dict(ports), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_ports(path: str | Path) -> dict[str, int] | None:
    """The ports a service wrote, or None while it has not written them yet."""
    try:
        with open(path) as f:
            ports = json.load(f)
    except FileNotFoundError:
        return None
    if not isinstance(ports, dict) or not all(isinstance(v, int) for v in ports.values()):
        raise ValueError(f"{path} is not a ports file: {ports!r}")
    return ports
