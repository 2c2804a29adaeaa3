"""The whole mesh on one GPU against the Engine alone on the same GPU and model.

    python -m bench.serving_gpu                       # H200: v3-width checkpoint, concurrency 256
    python -m bench.serving_gpu --device cpu --smoke  # the same code path with the tiny model (CI)

1. writes the checkpoint (`moemesh tiny-model --preset v3-width`, or the tiny model with --smoke);
2. `moemesh up --device D` with the prefill and the decode worker as separate processes, KV pushed by
   Mooncake (`--transport auto`: nvlink_intra with MC_INTRANODE_NVLINK=1 on CUDA, tcp if that mesh fails
   to start or to serve; tcp on CPU), up once the workers warmed up (on CUDA: kernels compiled and graphs
   captured, seconds per worker recorded; seconds to ready in `timings`); the GPU processes and their memory are recorded;
3. greedy token ids of a few prompts (below and above the scheduler's direct-prefill threshold, so both
   PD paths) through the gateway; the Mooncake transfer of one `--input-len` prompt's KV (all layers),
   from the prefill worker's transfer counters;
4. `moemesh bench`'s slow-down experiment (the seed's decode method: hold decode, fill the batch, release,
   measure) at concurrency `--concurrency`, input/output `--input-len`/`--output-len`;
5. the mesh stopped, the slowed run's requests through the in-process Engine (bench.serving_gpu_engine),
   and the greedy prompts compared.

`--cold` first empties the Triton cache, the user's GEMM tuning folder and (where FLASHINFER_WORKSPACE_BASE
is set) FlashInfer's JIT cache, as on a fresh machine; the record says `cold` and which folders it emptied.

The record (`benchmark` "serving_gpu") goes to $OUT/serving_gpu.json when OUT is set, else to
bench/results/serving_gpu_<device>.json; logs stay in a temp folder (their tails, with each service's native
stacks, copied to $OUT/logs when an attempt failed).
Every phase waits at most what is left of `--budget-s`; a phase that fails or runs out of time is
recorded as such and the record is written anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.pyspy import Profile
from bench.serving_gpu_mesh import (
    BENCH_SEED,
    MeshProcess,
    MeshUpError,
    Settings,
    decode_counters,
    decode_worker_full_batch,
    decode_worker_steps,
    engine_calls,
    greedy_through_mesh,
    kv_transfer,
    run_slowdown_bench,
    warmup_seconds,
)

RESULTS = Path(__file__).parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="tiny model, small numbers (CI, CPU)")
    ap.add_argument("--model", default="", help="an existing checkpoint folder instead of writing one")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=0, help="default 256 (smoke: 4)")
    ap.add_argument("--input-len", type=int, default=0, help="default 2000 (smoke: 300)")
    ap.add_argument("--output-len", type=int, default=0, help="default 100 (smoke: 12)")
    ap.add_argument("--slowdown-ms", type=float, default=0.0, help="default 500 (smoke: 150)")
    ap.add_argument("--transport", default="auto", choices=["auto", "tcp", "nvlink_intra"])
    ap.add_argument(
        "--gateways", type=int, default=0,
        help="gateway processes on the API port (default 2 on CUDA: one streams ~20-50k tok/s; smoke 1)",
    )  # fmt: skip
    ap.add_argument(
        "--client-procs", type=int, default=0,
        help="moemesh bench client processes (default 4 on CUDA, where one httpx client process streamed "
        "13.2k tok/s, 1 / its ~76 us per token; smoke 1)",
    )  # fmt: skip
    ap.add_argument(
        "--budget-s", type=float, default=0.0, help="whole run's time limit; default 520 (smoke: 240)"
    )
    ap.add_argument("--output", default="", help="record path (default: $OUT or bench/results)")
    ap.add_argument(
        "--profile", action="store_true",
        help="py-spy the decode worker and a gateway during the bench phase (bench/pyspy.py): each thread's "
        "hottest functions in the record, the raw samples beside it",
    )  # fmt: skip
    ap.add_argument(
        "--engine-reserve-s", type=float, default=-1.0,
        help="seconds of the budget kept for the Engine phase (default 150 on a GPU, 40 smoke, 5 with --engine-from)",
    )  # fmt: skip
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="slow-down runs against the one mesh, each with other prompts (as the budget allows): "
        "`served_over_engine` is their median, each run in `bench_repeats` (a 0.4 s full-batch window swings "
        "by +-0.07 between runs)",
    )  # fmt: skip
    ap.add_argument(
        "--engine-from", default="",
        help="take the Engine-alone phase (numbers and greedy ids) from an earlier record of the same preset, "
        "device and settings instead of running it (device time is scarce); the record names it",
    )  # fmt: skip
    ap.add_argument(
        "--cold", action="store_true",
        help="empty the Triton cache, the user's tuning folder and FlashInfer's JIT cache (when "
        "FLASHINFER_WORKSPACE_BASE is set) first: a first start on a fresh machine",
    )  # fmt: skip
    return ap.parse_args(argv)


def cold_caches() -> dict[str, Path]:
    """The compile and tuning caches a first start fills: Triton's, the user's GEMM tuning tables, and
    FlashInfer's JIT cache where FLASHINFER_WORKSPACE_BASE names its base."""
    from libs.kernels import gemm_tuning

    try:
        from triton import knobs

        triton_dir = Path(knobs.cache.dir)
    except ImportError:
        triton_dir = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    caches = {"triton_cache": triton_dir}
    tuning = gemm_tuning.cache_dir()
    if tuning is not None:
        caches["tuning"] = tuning
    if os.environ.get("FLASHINFER_WORKSPACE_BASE"):
        caches["flashinfer_jit"] = Path(os.environ["FLASHINFER_WORKSPACE_BASE"]) / ".cache" / "flashinfer"
    return caches


def empty_caches(caches: dict[str, Path]) -> dict[str, str]:
    """Each folder's contents removed (the folder kept); -> name: path of those emptied. Refuses a folder
    that holds the home folder or this checkout (a misset variable must not wipe them)."""
    guarded = {Path.home().resolve(), Path.cwd().resolve(), Path(__file__).resolve().parents[1]}
    emptied = {}
    for name, folder in caches.items():
        folder = folder.expanduser().resolve()
        if any(folder == g or folder in g.parents for g in guarded):
            raise ValueError(f"--cold: refusing to empty {folder} ({name}): it holds {guarded}")
        if folder.is_dir():
            for entry in folder.iterdir():
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        emptied[name] = str(folder)
    return emptied


def settings(a: argparse.Namespace) -> Settings:
    smoke = a.smoke
    return Settings(
        device=a.device, dtype="float32" if a.device == "cpu" else "bfloat16",
        concurrency=a.concurrency or (4 if smoke else 256), input_len=a.input_len or (300 if smoke else 2000),
        output_len=a.output_len or (12 if smoke else 100), slowdown_ms=a.slowdown_ms or (150 if smoke else 500),
        max_prefill_tokens=2048 if smoke else 16384, greedy_lens=(40, 300) if smoke else (100, 600, 2000),
        greedy_tokens=6 if smoke else 16, deadline=time.monotonic() + (a.budget_s or (240 if smoke else 520)),
        engine_reserve_s=(
            a.engine_reserve_s if a.engine_reserve_s >= 0 else 40 if smoke else 5 if a.engine_from else 150
        ),
        gateways=a.gateways or (2 if a.device == "cuda" and not smoke else 1),
        client_procs=a.client_procs or (4 if a.device == "cuda" and not smoke else 1),
    )  # fmt: skip


def write_model(a: argparse.Namespace, folder: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    if a.model:
        path = Path(a.model)
        info: dict[str, Any] = {"preset": "given", "path": str(path)}
    elif a.smoke:
        from libs.engine.tiny import write_tiny_model

        path = write_tiny_model(folder / "tiny", seed=0)
        info = {"preset": "tiny"}
    else:
        from libs.engine.preset_model import write_preset_model

        path = write_preset_model(folder / "v3-width", layers=a.layers, experts=a.experts, top_k=a.top_k)
        info = {"preset": "v3-width", "layers": a.layers, "experts": a.experts, "top_k": a.top_k}
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if a.device == "cuda":  # the tensors were drawn on the GPU: hand the memory back to the workers
        import torch

        torch.cuda.empty_cache()
    return info | {"dir": str(path), "bytes": size, "write_s": time.monotonic() - t0}


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)"


def transports(s: Settings, choice: str) -> list[str]:
    if choice != "auto":
        return [choice]
    return ["nvlink_intra", "tcp"] if s.device == "cuda" else ["tcp"]


def start_profiles(mesh: MeshProcess, out_dir: Path) -> dict[str, Profile]:
    """py-spy on decode-0 and on one gateway for the bench phase (bench/pyspy.py)."""
    profiles = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, module in (("decode-0", "services.decode_worker"), ("gateway", "services.gateway")):
        pid = mesh.service_pid(module)
        if pid is not None:
            profiles[name] = Profile.start(pid, out_dir / f"{name}.pyspy.txt")
    return profiles


def repeat_of(bench: dict[str, Any], worker: dict[str, Any]) -> dict[str, Any]:
    """One slow-down run's numbers for `bench_repeats`."""
    return {
        "full_batch_tok_s": bench.get("full_batch_tok_s"), "full_batch_window_s": bench.get("full_batch_window_s"),
        "full_batch_itl_ms": bench.get("full_batch_itl_ms"), "completed": bench.get("completed"),
        "failed": bench.get("failed"), "decode_worker_full_batch": worker,
    }  # fmt: skip


def serve(
    model_dir: Path, s: Settings, choice: str, logs: Path, rec: dict[str, Any], profile: bool = False,
    out_dir: Path | None = None, repeats: int = 1,
) -> None:  # fmt: skip
    """Phases 2-4 on the first transport whose mesh starts and serves the greedy prompts."""
    for transport in transports(s, choice):
        mesh = MeshProcess(model_dir, s, transport, logs / transport)
        try:
            t0 = time.monotonic()
            mesh.start()
            rec["timings"][f"mesh_up_{transport}_s"] = time.monotonic() - t0  # includes the workers' warm-up
            rec["timings"]["warmup_s"] = warmup_seconds(mesh)
            rec["gpu_processes"] = mesh.gpu_processes()
            rec["greedy_mesh"] = greedy_through_mesh(mesh, s)
            rec["engine_calls_after_greedy"] = engine_calls(mesh)  # sequential prompts: short ones inline
        except Exception as e:  # noqa: BLE001 - recorded, then the next transport
            why = f"{type(e).__name__}: {e}"
            if not isinstance(e, MeshUpError):  # the services' own words too (MeshUpError holds them already)
                why += "\n" + mesh.log_tails(600)
            rec["transport_failures"][transport] = why[-4000:]
            rec["stacks_dumped"] = mesh.dump_stacks()  # where each service was (in its log), then stop
            mesh.stop()
            continue
        try:
            rec["transport"] = transport
            rec["kv_transfer"] = kv_transfer(mesh, s)
            profiles = start_profiles(mesh, out_dir or logs) if profile else {}
            t0, before = time.monotonic(), decode_counters(mesh)
            rec["bench"] = run_slowdown_bench(mesh, s, logs / "bench.json")
            rec["timings"]["bench_s"] = time.monotonic() - t0
            rec["decode_worker_steps"] = decode_worker_steps(before, decode_counters(mesh))
            rec["decode_worker_full_batch"] = decode_worker_full_batch(mesh, s.concurrency)
            if profiles:
                rec["profile"] = {name: p.stop() for name, p in profiles.items()}
            rec["bench_repeats"] = [repeat_of(rec["bench"], rec["decode_worker_full_batch"])]
            per_run = rec["timings"]["bench_s"]
            for k in range(1, repeats):  # the same mesh, other prompts: one setting's spread, cheaply
                if s.left(s.engine_reserve_s) < 1.3 * per_run:
                    rec["repeats_skipped"] = f"{repeats - k} of {repeats}: the budget ran out"
                    break
                again = run_slowdown_bench(mesh, s, logs / f"bench-{k}.json", seed=BENCH_SEED + 1000 * k)
                rec["bench_repeats"].append(repeat_of(again, decode_worker_full_batch(mesh, s.concurrency)))
        finally:
            mesh.stop()
        return
    raise RuntimeError(f"no transport served: {rec['transport_failures']}")


def reference(model_dir: Path, s: Settings, rec: dict[str, Any], engine_from: str = "") -> None:
    if engine_from:
        earlier = json.loads(Path(engine_from).read_text())
        if earlier.get("model", {}).get("preset") != rec["model"].get("preset") or not earlier.get("engine"):
            raise ValueError(f"{engine_from} has no Engine phase of preset {rec['model'].get('preset')!r}")
        rec["engine"], rec["greedy_engine"] = earlier["engine"], earlier["greedy_engine"]
        rec["engine_from"] = engine_from
        return
    from bench.serving_gpu_engine import engine_reference

    t0 = time.monotonic()
    runs = max(1, len(rec.get("bench_repeats") or []))  # as many prompt sets as the mesh's repeats ran
    sets = [s.bench_prompts(model_dir, BENCH_SEED + 1000 * k) for k in range(runs)]
    ref = engine_reference(
        str(model_dir), s.device, s.dtype, s.engine_kwargs(), sets, s.output_len,
        s.greedy_prompts(), s.greedy_tokens,
    )  # fmt: skip
    rec["timings"]["engine_s"] = time.monotonic() - t0
    rec["engine"] = {k: v for k, v in ref.items() if k != "greedy"}
    rec["greedy_engine"] = ref["greedy"]


def summarize(rec: dict[str, Any]) -> None:
    """The headline fields, from what the phases recorded."""
    bench, engine = rec.get("bench") or {}, rec.get("engine") or {}
    runs = [r["full_batch_tok_s"] for r in rec.get("bench_repeats") or [] if r.get("full_batch_tok_s")]
    served = statistics.median(runs) if runs else bench.get("full_batch_tok_s")
    alone = engine.get("full_batch_tok_s")
    if alone and runs:
        rec["served_over_engine_runs"] = [r / alone for r in runs]
    rec["output_tok_s"] = served
    rec["engine_output_tok_s"] = alone
    rec["served_over_engine"] = served / alone if served and alone else None
    # both sides' requests (equal since 2026-12-02: the slow-down run asked logprobs before)
    rec["requests"] = ("greedy, ignore_eos; the mesh's streamed with stream_options.continuous_usage_stats "
                       "(no logprobs), the Engine's in process")  # fmt: skip
    # TTFT from the run without slow-down (the slowed run's includes the hold), ITL at full batch
    rec["ttft_ms"], rec["itl_ms"] = bench.get("baseline_ttft_ms"), bench.get("full_batch_itl_ms")
    rec["kv_transfer_GBps"] = (rec.get("kv_transfer") or {}).get("GBps")
    mesh, ref = rec.get("greedy_mesh"), rec.get("greedy_engine")
    if mesh and ref:
        same = [a == b for a, b in zip(mesh, ref, strict=True)]
        rec["greedy_equal"] = f"{sum(same)}/{len(same)}"


def save(rec: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    # SIGTERM (an outer `timeout`) unwinds like an exception: the mesh is stopped and the record written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    s = settings(a)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
    path = (
        Path(a.output) if a.output else out_dir / f"serving_gpu_{'smoke_' if a.smoke else ''}{a.device}.json"
    )
    rec: dict[str, Any] = {
        "benchmark": "serving_gpu", "command": "python -m bench.serving_gpu " + " ".join(argv or sys.argv[1:]),
        "device": device_name(a.device), "concurrency": s.concurrency, "input_len": s.input_len,
        "gateways": s.gateways, "client_procs": s.client_procs,
        "output_len": s.output_len, "slowdown_ms": s.slowdown_ms, "timings": {}, "transport_failures": {},
        "errors": [],
    }  # fmt: skip
    if a.cold:
        rec["cold"], rec["emptied"] = True, empty_caches(cold_caches())
        print(f"cold start: emptied {rec['emptied']}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="serving-gpu-"))
    try:
        rec["model"] = write_model(a, tmp)
        print(f"model: {rec['model']}", flush=True)
        model_dir = Path(rec["model"]["dir"])
        for phase in (lambda: serve(model_dir, s, a.transport, tmp / "logs", rec, a.profile, path.parent, a.repeats),
                      lambda: reference(model_dir, s, rec, a.engine_from)):  # fmt: skip
            try:
                phase()
            except Exception as e:  # noqa: BLE001 - the record says which phase failed and why
                rec["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
                print(rec["errors"][-1], file=sys.stderr, flush=True)
            save(rec, path)  # what has run so far survives a kill
    except SystemExit:
        rec["errors"].append("stopped by SIGTERM (out of time?)")
        raise
    finally:
        summarize(rec)
        failed = rec["errors"] or rec["transport_failures"]  # any failed attempt's logs, stacks
        if failed and os.environ.get("OUT"):
            for log in (tmp / "logs").rglob("*.log"):
                dest = Path(os.environ["OUT"]) / "logs" / log.relative_to(tmp / "logs")
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(log.read_text(errors="replace")[-20000:])
        shutil.rmtree(tmp, ignore_errors=True)
        save(rec, path)
        print(f"wrote {path}", flush=True)
    for k in ("transport", "output_tok_s", "engine_output_tok_s", "served_over_engine", "kv_transfer_GBps",
              "greedy_equal"):  # fmt: skip
        print(f"{k}: {rec.get(k)}", flush=True)
    return rec


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
