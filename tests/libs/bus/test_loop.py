"""The services' event loop choice (libs/bus/loop.py)."""

from __future__ import annotations

import asyncio

import pytest

from libs.bus.loop import loop_kind, run


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_takes_uvloop_when_installed_and_asyncio_on_request() -> None:
    pytest.importorskip("uvloop")
    assert loop_kind("auto") == "uvloop"
    assert run(_loop_module(), "auto").startswith("uvloop")
    assert run(_loop_module(), "asyncio").startswith("asyncio")


def test_a_bad_choice_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="auto, uvloop or asyncio"):
        loop_kind("tokio")


def test_every_service_defaults_to_auto() -> None:
    from libs.bus.settings import ServiceSettings
    from services.gateway.settings import GatewaySettings
    from services.scheduler.service import SchedulerSettings

    assert ServiceSettings().event_loop == "auto"
    assert SchedulerSettings().event_loop == "auto"
    assert GatewaySettings(model_dir="/m").event_loop == "auto"
