"""bench.mesh_ab's settings: each MOEMESH_<SERVICE>_<FIELD> goes to its service, MOEMESH_*_ to every one."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from bench.mesh_ab import SERVICES, mesh_config, parse_settings
from libs.launch.mesh import Mesh


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


def test_the_gateways_embedded_scheduler_setting_is_the_launchers_embedded_mode(tmp_path: Path) -> None:
    on = mesh_config(tmp_path, parse_settings("MOEMESH_GATEWAY_EMBEDDED_SCHEDULER=true"), 16)
    assert (
        on.embedded_scheduler and "MOEMESH_GATEWAY_EMBEDDED_SCHEDULER" not in on.extra_env["services.gateway"]
    )
    assert on.extra_env["services.scheduler"]["MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD"] == "16"
    assert (
        Mesh(replace(on, log_dir=tmp_path)).scheduler_names() == []
    )  # no scheduler process: the gateway hosts it
    assert not mesh_config(tmp_path, parse_settings(""), 16).embedded_scheduler


def test_a_source_tree_goes_first_on_every_services_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "before"
    (src / "services" / "gateway").mkdir(parents=True)
    site = tmp_path / "site"  # a device run's bundle of packages: kept, after the tree; this checkout dropped
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(Path.cwd())]))
    cfg = mesh_config(tmp_path, parse_settings("MOEMESH_SCHEDULER_X=1"), 16, src)
    for module in SERVICES.values():
        env = cfg.extra_env[module]
        assert (env["PYTHONPATH"], env["PYTHONSAFEPATH"]) == (
            os.pathsep.join([str(src.resolve()), str(site)]),
            "1",
        )
    assert cfg.extra_env["services.scheduler"]["MOEMESH_SCHEDULER_X"] == "1"
    assert all("PYTHONPATH" not in env for env in mesh_config(tmp_path, {}, 16).extra_env.values())
    with pytest.raises(ValueError, match="not a moemesh source tree"):
        mesh_config(tmp_path, {}, 16, tmp_path / "nothing")
