"""Which event loop a service runs on (ServiceSettings.event_loop): asyncio's own, or uvloop (libuv),
with "auto" taking uvloop when it is installed. `run` is the entry point's `asyncio.run`."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_kind(requested: str) -> str:
    """"auto" -> "uvloop" when it is importable, else "asyncio"; "uvloop" that is missing is an error."""
    have = importlib.util.find_spec("uvloop") is not None
    if requested == "uvloop" and not have:
        raise ValueError("event_loop=uvloop but uvloop is not installed")
    if requested not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"event_loop must be auto, uvloop or asyncio, got {requested!r}")
    return "uvloop" if requested == "uvloop" or (requested == "auto" and have) else "asyncio"


def run(main: Coroutine[Any, Any, T], requested: str = "asyncio") -> T:
    if loop_kind(requested) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
