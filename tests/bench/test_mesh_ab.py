"""bench.mesh_ab's settings: each MOEMESH_<SERVICE>_<FIELD> goes to its service, MOEMESH_*_ to every one."""

from __future__ import annotations

import pytest

from bench.mesh_ab import SERVICES, parse_settings


def test_settings_go_to_their_service_and_star_to_every_one() -> None:
    got = parse_settings(
        "MOEMESH_*_EVENT_LOOP=uvloop, MOEMESH_GATEWAY_EVENT_LOOP=asyncio,MOEMESH_KV_BROKER_X=1"
    )
    assert set(got) == set(SERVICES.values())
    assert got["services.gateway"] == {"MOEMESH_GATEWAY_EVENT_LOOP": "asyncio"}
    assert got["services.kv_broker"] == {"MOEMESH_KV_BROKER_EVENT_LOOP": "uvloop", "MOEMESH_KV_BROKER_X": "1"}
    assert got["services.decode_worker"] == {"MOEMESH_DECODE_WORKER_EVENT_LOOP": "uvloop"}
    assert parse_settings("") == {}


@pytest.mark.parametrize("bad", ["EVENT_LOOP=uvloop", "MOEMESH_ROUTER_X=1", "MOEMESH_GATEWAY_X"])
def test_a_bad_setting_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="MOEMESH_"):
        parse_settings(bad)
