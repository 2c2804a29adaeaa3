"""Fault tolerance and overload on the real mesh (CPU, tiny model): the kill table and the overload (10x
capacity offered by default; see `sent_over_capacity` for what was delivered).

    python -m bench.chaos [--requests 24] [--max-tokens 48] [--overload-seconds 30] [--overload-factor 10]

1. Kill table, under the launcher `moemesh up` runs (libs.launch.mesh, its supervisor restarting what
   dies): with 2 prefill + 2 decode workers and 2 scheduler replicas, while N greedy streams run
   (ignore_eos, long enough that none has finished at the strike), SIGKILL a decode worker, a prefill
   worker, a scheduler replica, the kv-broker and the nats-server, one at a time; per strike: requests,
   completed with the undisturbed text (in-process Engine), migrated, clean errors, wrong, hung, pages
   left on the workers once traffic stopped, streams already finished at the strike, the supervisor's
   restarts of the killed service and the seconds until it served again.
2. Overload, on a mesh of its own (decode waiting line 4): measure its capacity (requests/s at a fixed
   concurrency), then offer `factor` x that for `seconds` with the schedulers' queues bounded at
   --max-queue (the client's in-flight cap can hold
   arrivals back: `sent_rps` and `sent_over_capacity` are the load delivered): answers by status
   (429 + Retry-After), whether every admitted request finished, and the RSS of each service process
   (from /proc) at the start, the highest sampled, at the end, and the kernel's high-water mark.
JSON to bench/results/chaos.json; the table is printed.

On a GPU (issue 18's "one decode worker killed mid-stream" on one H200):

    python -m bench.chaos --device cuda --preset v3-width --faults decode-0 --skip-overload

runs the same mesh with every worker on the GPU (4 processes: 2 prefill + 2 decode, each warming up and
reading the FP8 GEMM tuning table first), kills decode-0 mid-stream and reports the same row: streams
completed and migrated, pages left on the workers (from /metrics), the supervisor's restart. `wrong`
compares with the Engine alone on the same GPU: bf16 sums in another batch can flip a near-tie token, so on
a GPU it is reported, not required to be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from libs.chaos.overload import measure_capacity, overload, service_pids
from libs.chaos.scenarios import chaos_config, chaos_prompts, run_fault, standard_faults
from libs.engine import Engine, SamplingParams
from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh
from libs.loadgen.report import write_json

COLUMNS = (
    "killed",
    "requests",
    "completed",
    "migrated",
    "errors",
    "wrong",
    "hung",
    "leaked_pages",
    "max_seconds",
    "finished_before_strike",
    "restarts",
    "back_s",
)


def table(rows: list[dict]) -> str:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    return "\n".join([line(COLUMNS), *(line([r[c] for c in COLUMNS]) for r in rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: a fresh tiny model)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--overload-seconds", type=float, default=30.0)
    p.add_argument("--overload-factor", type=float, default=10.0)
    p.add_argument("--max-queue", type=int, default=64, help="each scheduler replica's queue bound")
    p.add_argument("--gateway-max-in-flight", type=int, default=256, help="the gateway's own bound (429)")
    p.add_argument("--skip-faults", action="store_true")
    p.add_argument("--skip-overload", action="store_true")
    p.add_argument("--faults", default="", help="comma-separated services to kill (default: the whole table)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", default="", choices=["", "v3-width"], help="write this preset's checkpoint")
    p.add_argument(
        "--scheduler", choices=["process", "embedded"], default="process",
        help="embedded: 2 gateways each hosting a scheduler replica, no scheduler process (its kill row is left out)",
    )  # fmt: skip
    p.add_argument("--out", default="bench/results/chaos.json")
    args = p.parse_args(argv)

    model = checkpoint(args)
    prompts = chaos_prompts(args.requests)
    want = reference(model, prompts, args.max_tokens) if args.device == "cpu" else None
    password = os.urandom(8).hex()
    limits = {
        "services.scheduler": {"MOEMESH_SCHEDULER_MAX_QUEUE": str(args.max_queue)},
        "services.gateway": {"MOEMESH_GATEWAY_MAX_IN_FLIGHT": str(args.gateway_max_in_flight)},
    }
    result: dict = {
        "command": shlex.join(["python", "-m", "bench.chaos", *(sys.argv[1:] if argv is None else argv)]),
        "environment": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "mesh": "2 prefill + 2 decode workers, 2 schedulers, kv-broker, gateway, nats (user/password); "
        f"{'tiny model on CPU' if args.device == 'cpu' else 'see below'}; decode forward_sleep_ms 25, 64 KV pages per decode worker, lease 4 s; every service "
        "supervised by the launcher (restart backoff 0.5 s); decode waiting line 1 for the kill table (requests "
        "wait at the schedulers), 4 for the overload (a mesh of its own)",
    }  # fmt: skip
    if args.device != "cpu":
        result["mesh"] += (
            f"; here every worker on {args.device}, model {args.preset or model}; `completed` checks each "
            "stream's length, not its tokens (bench.chaos.reference says why)"
        )
    chosen = {f for f in args.faults.split(",") if f}
    embedded = args.scheduler == "embedded"
    if embedded:
        result["mesh"] += (
            "; --scheduler embedded: 2 gateways, each hosting a scheduler replica, no scheduler process"
        )
    if not args.skip_faults:
        with start_mesh(model, args.device, password, limits, embedded) as mesh:
            print(f"mesh up ({mesh.url}); logs in {mesh.log_dir}", flush=True)
            result["faults"] = kill_table(mesh, prompts, want, args.max_tokens, chosen, embedded)
    if not args.skip_overload:
        limits["services.scheduler"]["MOEMESH_SCHEDULER_MAX_DECODE_WAITING"] = "4"
        with start_mesh(model, args.device, password, limits, embedded) as mesh:
            print(f"overload mesh up ({mesh.url}); logs in {mesh.log_dir}", flush=True)
            result["overload"] = overload_run(mesh, prompts[0], args.overload_factor, args.overload_seconds)
        print(json.dumps(result["overload"], indent=1))
    print(f"wrote {write_json(args.out, result)}")
    return 0


def checkpoint(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    folder = Path(tempfile.mkdtemp())
    if args.preset:
        from libs.engine.preset_model import write_preset_model

        return write_preset_model(folder / args.preset, args.preset, device=args.device)
    return write_tiny_model(folder / "tiny-v3", seed=0)


@contextlib.contextmanager
def start_mesh(
    model: Path, device: str, password: str, limits: dict[str, dict[str, str]], embedded: bool = False
) -> Iterator[Mesh]:
    """The chaos mesh, on `device`: on a GPU each worker warms up before its first heartbeat (minutes when
    its FP8 GEMMs are not in the tuning table yet), so the mesh gets `moemesh up`'s CUDA ready timeout.
    embedded: the schedulers are hosted by 2 gateways instead (`moemesh up --scheduler embedded`)."""
    from libs.cli.up import ready_timeout

    cfg = dataclasses.replace(chaos_config(model, None, password=password, extra_env=limits), device=device)
    if embedded:
        cfg = dataclasses.replace(cfg, embedded_scheduler=True, schedulers=1, gateways=2)
    mesh = Mesh(cfg).start(timeout=ready_timeout(None, device))
    try:
        yield mesh
    finally:
        mesh.stop()


def reference(model: Path | str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy token ids from the Engine alone (float32 on the CPU: the mesh must match them
    exactly). Not on a GPU: there bf16 results depend on the batch a request shares (no batch-invariant
    kernels) and the random weights' near-ties turn that into other tokens, so the GPU run checks lengths."""
    engine = Engine.from_pretrained(model)
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


def kill_table(
    mesh: Mesh, prompts: list[list[int]], want: list[list[int]] | None, max_tokens: int, chosen: Collection[str] = (),
    embedded: bool = False,
) -> list[dict]:  # fmt: skip
    rows = []
    faults = [f for f in standard_faults(len(prompts)) if not chosen or f.killed in chosen]
    if embedded:  # no scheduler process to kill (killing a gateway ends the streams it carries by nature)
        faults = [f for f in faults if not f.killed.startswith("scheduler")]
    for fault in faults:
        row, _ = run_fault(mesh, fault, prompts, want, max_tokens, deadline_s=90.0, leak_timeout_s=15.0)
        rows.append(row.as_dict())
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print("\n" + table(rows), flush=True)
    return rows


def overload_run(mesh: Mesh, prompt: list[int], factor: float, seconds: float) -> dict:
    capacity = asyncio.run(
        measure_capacity(mesh.url, mesh.model_name, prompt, 8, concurrency=16, seconds=5.0)
    )
    rate = capacity * factor
    print(f"capacity {capacity:.1f} req/s; offering {rate:.1f} req/s for {seconds:.0f} s", flush=True)
    t0 = time.monotonic()
    over = asyncio.run(overload(mesh.url, mesh.model_name, prompt, 8, rate, seconds, service_pids(mesh)))
    return {"capacity_rps": round(capacity, 2), "factor": factor, **over.as_dict(),
            "sent_over_capacity": round(over.sent_rps / capacity, 2),
            "wall_seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
