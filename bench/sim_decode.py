"""The served decode path at a GPU's step time, on the CPU: `moemesh up` with timing-model workers (libs/sim,
the decode step modeled on the H200 records, `--sim-speed` times faster) and `moemesh bench`'s slow-down
experiment at a full batch, exactly as bench.serving_gpu runs them on a GPU, with settings A and B in
alternate runs (`MOEMESH_<SERVICE>_<FIELD>=value`, comma-separated, as bench.mesh_ab takes them).

    python -m bench.sim_decode --b MOEMESH_DECODE_WORKER_OVERLAP_PUBLISH=false [--pairs 2]

Each run records the full-batch tokens/s and ITL at the client and the decode worker's mean engine step;
the modeled step at the full batch is in the record, so what the mesh adds to it shows. On a 2-core
machine the client, gateway and workers share the cores: the numbers there are bounded by the machine,
and the record keeps its load average. Writes bench/results/sim_decode.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serving_gpu import start_profiles
from bench.serving_gpu_mesh import (
    MeshProcess,
    Settings,
    decode_counters,
    decode_worker_full_batch,
    decode_worker_steps,
    run_slowdown_bench,
)
from libs.engine.tiny import write_tiny_model
from libs.loadgen.report import write_json
from libs.sim.step_time import H200_DECODE


def settings_of(text: str) -> dict[str, str]:
    """'MOEMESH_A=1,MOEMESH_B=x' -> {MOEMESH_A: 1, MOEMESH_B: x}; '' -> {}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.startswith("MOEMESH_"):
            raise ValueError(f"settings are MOEMESH_<SERVICE>_<FIELD>=value, got {part!r}")
        out[key] = value
    return out


def one_run(model: Path, s: Settings, logs: Path, profile: Path | None = None) -> dict[str, Any]:
    """The mesh, one slow-down bench (py-spy on decode-0 and a gateway during it, with `profile`), the mesh
    stopped."""
    mesh = MeshProcess(model, s, "tcp", logs)
    mesh.start()
    try:
        profiles = start_profiles(mesh, profile) if profile is not None else {}
        before = decode_counters(mesh)
        r = run_slowdown_bench(mesh, s, logs / "bench.json")
        steps = decode_worker_steps(before, decode_counters(mesh))
        worker = decode_worker_full_batch(mesh, s.concurrency)
        summaries = {name: p.stop() for name, p in profiles.items()}
    finally:
        mesh.stop()
    out = {"full_batch_tok_s": r["full_batch_tok_s"], "full_batch_itl_ms": r["full_batch_itl_ms"],
           "completed": r["completed"], "failed": r["failed"], "decode_worker_steps": steps,
           "decode_worker_full_batch": worker}  # fmt: skip
    return out | ({"profile": summaries} if profile is not None else {})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default="", help="settings of side A (default: none)")
    ap.add_argument("--b", default="", help="settings of side B")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--sim-speed", type=float, default=9.0, help="9: ~5.6 ms per step at 256 x 2,050 tokens")
    ap.add_argument("--profile", metavar="DIR", help="py-spy on decode-0 and a gateway in each run; raw files in DIR")
    ap.add_argument("--output", default=str(Path(__file__).parent / "results" / "sim_decode.json"))
    a = ap.parse_args(argv)
    sides = {"A": settings_of(a.a), "B": settings_of(a.b)}
    sim = {f"MOEMESH_{role}_WORKER_{k}": v for role in ("DECODE", "PREFILL")
           for k, v in (("ENGINE", "sim"), ("SIM_SPEED", f"{a.sim_speed:g}"))}  # fmt: skip
    step_ms = (
        H200_DECODE.step_ms(a.concurrency, a.concurrency * (a.input_len + a.output_len // 2)) / a.sim_speed
    )
    rec: dict[str, Any] = {
        "benchmark": "sim_decode", "sides": sides, "sim_speed": a.sim_speed, "concurrency": a.concurrency,
        "input_len": a.input_len, "output_len": a.output_len, "modeled_step_ms": step_ms,
        "modeled_tok_s": 1000 * a.concurrency / step_ms, "cpus": os.cpu_count(), "runs": [],
        "load_avg_before": os.getloadavg(),
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sim-decode-") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", seed=0)
        for i in range(a.pairs):
            for side in "AB" if i % 2 == 0 else "BA":  # alternate which side goes first
                s = Settings(
                    device="cpu", dtype="float32", concurrency=a.concurrency, input_len=a.input_len,
                    output_len=a.output_len, slowdown_ms=100, max_prefill_tokens=16384, greedy_lens=(),
                    greedy_tokens=1, deadline=time.monotonic() + 600, engine_reserve_s=0,
                    extra_env={**sim, **sides[side]},
                )  # fmt: skip
                prof = Path(a.profile) / f"{i}{side}" if a.profile else None
                run = one_run(model, s, Path(tmp) / f"logs-{i}-{side}", prof)
                rec["runs"].append({"pair": i, "side": side, "load_avg": os.getloadavg(), **run})
                w = run["decode_worker_full_batch"]
                idle = (w.get("engine_idle_ms") or {}).get("median", float("nan"))
                print(f"pair {i} {side}: {run['full_batch_tok_s']:,.0f} tok/s, ITL median "
                      f"{run['full_batch_itl_ms']['median']:.2f} ms; decode-0 itself {w.get('tokens_per_s') or 0:,.0f} "
                      f"tok/s, engine idle between steps {idle:.2f} ms", flush=True)  # fmt: skip
    write_json(a.output, rec)
    print(f"modeled step {step_ms:.2f} ms ({rec['modeled_tok_s']:,.0f} tok/s); wrote {a.output}")
    return rec


if __name__ == "__main__":
    main()
