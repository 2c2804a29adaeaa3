"""bench/serving_gpu's whole path on CPU (`--device cpu --smoke`): the tiny model through `moemesh up` (real
nats-server, worker processes, Mooncake TCP), `moemesh bench`'s slow-down experiment and the in-process
Engine; keeps the GPU benchmark from rotting between device runs. Asserts what must hold on any machine
(every request served, the mesh's greedy ids equal to the Engine's, the KV bytes one prompt needs), not
speeds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from libs.engine.tiny import TINY_CONFIG as c

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_a_complete_record(tmp_path: Path) -> None:
    out = tmp_path / "serving_gpu.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.serving_gpu", "--device", "cpu", "--smoke", "--repeats", "2", "--output", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["errors"] == [], rec["errors"]
    assert done.returncode == 0
    assert rec["benchmark"] == "serving_gpu" and rec["transport"] == "tcp"
    assert rec["model"]["preset"] == "tiny" and rec["concurrency"] == 4
    bench = rec["bench"]
    assert (bench["completed"], bench["failed"]) == (4, 0)
    assert bench["release_reason"] in ("target", "stalled") and bench["batch_at_release"] >= 1
    assert rec["output_tok_s"] > 0 and rec["engine_output_tok_s"] > 0 and rec["served_over_engine"] > 0
    assert rec["engine"]["stats_after"]["running"] == 0 and rec["engine"]["stats_after"]["reserved"] == 0
    # the mesh's greedy ids (both PD paths) equal the Engine's on the same prompts
    assert rec["greedy_equal"] == "2/2" and rec["greedy_mesh"] == rec["greedy_engine"]
    assert all(len(ids) == 6 for ids in rec["greedy_mesh"])
    # each worker's engine calls by where they ran (moemesh_worker_engine_calls_total{on}), read after them
    calls = rec["engine_calls_after_greedy"]
    assert set(calls) == {"prefill-0", "decode-0"}
    assert all(c["loop"] + c["thread"] > 0 for c in calls.values()), calls
    # one 300-token prompt's KV: every layer's latent rows (kv_lora_rank + rope dims, float32) of its pages
    row = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4 * c["num_hidden_layers"]
    assert rec["kv_transfer"]["bytes"] == row * 16 * math.ceil(300 / 16)
    assert rec["kv_transfer_GBps"] > 0
    assert rec["timings"]["warmup_s"] == {"prefill-0": 0.0, "decode-0": 0.0}  # auto: off on the CPU
    assert set(rec["ttft_ms"]) >= {"median", "p90", "p99"} and bench["baseline_itl_ms"]["count"] > 0
    # ITL at full batch: its window runs from the release to the first finish, which on a loaded box can hold
    # no token gap (the baseline's ITL above always has them)
    assert "count" in rec["itl_ms"]
    # decode-0's steps over the bench phase: the slowed and the baseline run's tokens, all but each first one
    steps = rec["decode_worker_steps"]
    assert steps["steps"] > 0 and steps["step_ms_mean"] > 0 and steps["tokens"] >= 2 * 4 * (12 - 1)
    # decode-0's own step trace over the full batch after the release (libs/worker/step_trace.py)
    full = rec["decode_worker_full_batch"]
    assert full["steps"] >= 2 and full["tokens_per_s"] > 0, full
    assert full["engine_step_ms"]["median"] > 0 and full["publish_ms"]["median"] >= 0
    # --repeats 2: a second slow-down run with other prompts against the same mesh; the headline is the median
    runs = rec["bench_repeats"]
    assert len(runs) == 2 and all((r["completed"], r["failed"]) == (4, 0) for r in runs), runs
    assert all(r["decode_worker_full_batch"]["steps"] >= 2 for r in runs), runs
    assert rec["served_over_engine_runs"] == [
        r["full_batch_tok_s"] / rec["engine_output_tok_s"] for r in runs
    ]
    assert (
        min(rec["served_over_engine_runs"])
        <= rec["served_over_engine"]
        <= max(rec["served_over_engine_runs"])
    )
    # and the Engine alone ran the same two prompt sets: its headline is their median
    alone = [r["full_batch_tok_s"] for r in rec["engine"]["repeats"]]
    assert len(alone) == 2 and all(x > 0 for x in alone)
    assert rec["engine_output_tok_s"] == pytest.approx(sum(alone) / 2)


def test_a_failed_attempt_can_ask_every_service_for_its_stacks(tmp_path: Path) -> None:
    """What serving_gpu does before it stops an attempt that failed: SIGUSR1 to each service process of the
    mesh; each writes every thread's stack into its log and keeps running."""
    from bench.pyspy import executable as pyspy_executable
    from bench.serving_gpu import parse_args, settings
    from bench.serving_gpu_mesh import MeshProcess
    from libs.engine.tiny import write_tiny_model

    s = settings(parse_args(["--device", "cpu", "--smoke"]))
    mesh = MeshProcess(write_tiny_model(tmp_path / "tiny", seed=0), s, "tcp", tmp_path / "logs")
    try:
        mesh.start()
        pids = mesh.service_pids()
        assert len(pids) >= 5  # gateway, scheduler, kv-broker, prefill and decode worker
        assert mesh.dump_stacks(wait_s=30) == len(pids)
        dumped = [
            p.name for p in (tmp_path / "logs").glob("*.log") if "(most recent call first)" in p.read_text()
        ]
        assert len(dumped) >= len(pids), dumped
        # with py-spy installed (optional: bench/pyspy.py), each one's native + Python stacks beside the logs
        # (py-spy's error instead, without ptrace rights); without it, none and no failure
        stacks = {p.name for p in (tmp_path / "logs").glob("stacks-*.log")}
        if pyspy_executable() is None:
            assert stacks == set()
        for pid in pids if pyspy_executable() else ():
            text = (tmp_path / "logs" / f"stacks-{pid}.log").read_text()
            assert "services." in text.splitlines()[0], text[:500]
            assert "Thread" in text or "failed" in text or "Error" in text, text[:500]
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)  # still running
    finally:
        mesh.stop()
