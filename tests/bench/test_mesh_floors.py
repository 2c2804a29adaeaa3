"""bench.mesh_floors runs end to end at a few samples (the numbers are the benchmark's; here: every floor
is measured through its real library and comes back as positive milliseconds)."""

from __future__ import annotations

from bench import mesh_floors as F


def test_every_floor_is_measured() -> None:
    http = F.http_floor(5)
    bus = F.bus_floor(5)
    mc = F.mooncake_floor()
    eng = F.engine_floor(3)
    assert http["ttft_p50_ms_back_to_back"] > 0 and http["ttft_p50_ms_after_idle"] > 0
    assert bus["request_reply_p50_ms"] > bus["one_way_p50_ms_estimate"] > 0
    assert mc["write_8mib_ms"] > 0 and mc["longest_python_stall_ms_beside_writes"] > 0
    assert set(eng) == {"prefill_5_tokens", "prefill_40_tokens"}
    assert all(v > 0 for row in eng.values() for v in row.values())
    assert set(eng["prefill_5_tokens"]) == {
        "step_p50_ms_back_to_back", "step_p50_ms_after_idle",
        "step_p50_ms_after_spin_0.5ms", "step_p50_ms_after_spin_2ms", "step_p50_ms_after_spin_10ms",
    }  # fmt: skip


def test_http_and_bus_floors_on_uvloop() -> None:
    http = F.http_floor(3, "uvloop")
    bus = F.bus_floor(3, "uvloop")
    assert http["ttft_p50_ms_back_to_back"] > 0 and http["ttft_p50_ms_after_idle"] > 0
    assert bus["request_reply_p50_ms"] > bus["one_way_p50_ms_estimate"] > 0
