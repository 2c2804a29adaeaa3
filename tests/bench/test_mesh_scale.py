"""bench.mesh_scale's arithmetic on recorded numbers: bus traffic net of the idle rate, the projection,
the shared-prefix prompts, percentiles; and the sim host builds real worker services from settings."""

from __future__ import annotations

import pytest

from bench.mesh_scale import per_unit, projection
from bench.scale_load import pct, prompt
from bench.sim_host import make_workers
from services.decode_worker.service import DecodeWorker
from services.prefill_worker.service import PrefillWorker


def test_bus_traffic_per_request_and_token_is_net_of_the_idle_rate() -> None:
    idle = {"bus_per_s": {"in_msgs": 10.0, "out_msgs": 100.0, "in_bytes": 1000.0, "out_bytes": 9000.0}}
    step = {"seconds": 2.0, "bus": {"in_msgs": 220, "out_msgs": 400, "in_bytes": 42_000, "out_bytes": 58_000}}
    u = per_unit(step, requests=10, tokens=100, idle=idle)
    assert u["msgs_per_request"] == pytest.approx(20.0) and u["msgs_per_token"] == pytest.approx(2.0)
    assert u["bytes_per_request"] == pytest.approx(4000.0) and u["bytes_per_token"] == pytest.approx(400.0)
    assert u["delivered_msgs_per_request"] == pytest.approx(20.0)


def test_projection_scales_per_core_rates_to_the_target() -> None:
    p = projection({"tokens_per_s_per_gateway_core": 20_000}, {"placements_per_scheduler_core": 2_000}, 32)
    assert p["requests_per_s"] == pytest.approx(364_000 / 32)
    assert p["gateway_cores"] == pytest.approx(18.2) and p["scheduler_cores"] == pytest.approx(5.6875)


def test_prompts_share_exactly_their_prefix_and_percentiles_pick_ranks() -> None:
    a, b = prompt(64, 1, shared=32), prompt(64, 2, shared=32)
    assert len(a) == 64 and a[:32] == b[:32] and a[32:] != b[32:]
    salts = [s * 900 + 5 for s in range(50)] + list(range(2_000))  # multiples of 900 apart as well
    pages = {tuple(prompt(64, s, shared=32)[32:48]) for s in salts}
    assert len(pages) == len(set(salts))  # every salt's first page after the shared part is its own
    assert all(3 <= t <= 902 for s in (0, 899, 10**6) for t in prompt(300, s, shared=100))
    assert len(prompt(34, 7, shared=32)) == 34 and len(prompt(32, 7, shared=32)) == 32
    assert pct([5.0, 1.0, 3.0], 50) == 3.0 and pct(list(range(101)), 99) == 99
    assert pct([], 50) != pct([], 50)  # NaN: no samples


def test_sim_host_makes_sim_worker_services(tmp_path) -> None:
    ws = make_workers(["d0", "d1"], ["p0"], {"model_dir": str(tmp_path), "nats_url": "nats://127.0.0.1:1"})
    assert [type(w) for w in ws] == [DecodeWorker, DecodeWorker, PrefillWorker]
    assert all(w.settings.engine == "sim" and w.settings.transfer_protocol == "skip" for w in ws)
    assert [w.settings.instance_id for w in ws] == ["d0", "d1", "p0"]
