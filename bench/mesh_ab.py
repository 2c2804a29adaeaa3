"""TTFT of two mesh configurations, A and B, up at the same time and asked in turn, request by request.

    python -m bench.mesh_ab --b 'MOEMESH_*_EVENT_LOOP=uvloop' [--a ''] [--requests 200]
                            [--prompt-lens 5,40,200] [--a-src DIR] [--b-src DIR]

On a shared machine the load moves more between two runs a minute apart than a change of 1 ms moves TTFT;
here both meshes see the same moments: request i goes to A then B (B then A for odd i), the same prompt to
each. Settings are `MOEMESH_<SERVICE>_<FIELD>=value`, comma-separated; `MOEMESH_*_<FIELD>` sets it for every
service. Both meshes are bench.mesh_ttft's (tiny model, prefix caches off, `--direct-threshold`).
`MOEMESH_GATEWAY_EMBEDDED_SCHEDULER=true` is the launcher's embedded mode (`moemesh up --scheduler embedded`):
no scheduler process, the gateway hosts one (with that side's MOEMESH_SCHEDULER_* settings).
`--a-src DIR` / `--b-src DIR` run that side's services from another source tree (a checkout of another
commit: `git worktree add /tmp/before <commit>`), to compare code, not settings (`--b ''` then).
Writes bench/results/mesh_ab.json: per prompt length, each side's p50 / p99 / mean, and the paired
differences (B minus A of the same i).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

from bench.mesh_ttft import first_token_ms, prompt_of, ttft_body
from bench.mesh_ttft import summarize as summary
from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh, MeshConfig
from libs.loadgen.report import write_json

SERVICES = {
    "GATEWAY": "services.gateway",
    "SCHEDULER": "services.scheduler",
    "KV_BROKER": "services.kv_broker",
    "PREFILL_WORKER": "services.prefill_worker",
    "DECODE_WORKER": "services.decode_worker",
}


def parse_settings(text: str) -> dict[str, dict[str, str]]:
    """'MOEMESH_SCHEDULER_X=1,MOEMESH_*_Y=2' -> {module: {env name: value}}; ValueError on anything else."""
    out: dict[str, dict[str, str]] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.startswith("MOEMESH_"):
            raise ValueError(f"expected MOEMESH_<SERVICE>_<FIELD>=value, got {item!r}")
        rest = key.removeprefix("MOEMESH_")
        if rest.startswith("*_"):
            for svc, module in SERVICES.items():
                out.setdefault(module, {})[f"MOEMESH_{svc}_{rest[2:]}"] = value
            continue
        named = next((s for s in SERVICES if rest.startswith(s + "_")), None)
        if named is None:
            raise ValueError(f"{key}: no service of {sorted(SERVICES)} named after MOEMESH_")
        out.setdefault(SERVICES[named], {})[key] = value
    return out


def mesh_config(
    model: Path, settings: dict[str, dict[str, str]], direct_threshold: int, src: Path | None = None
) -> MeshConfig:
    """bench.mesh_ttft's mesh with these settings; with `src`, every service imported from that source tree
    (first on its PYTHONPATH, then the rest of this process's PYTHONPATH, this checkout left off it)."""
    base = {
        "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": str(direct_threshold)},
        "services.prefill_worker": {"MOEMESH_PREFILL_WORKER_ENABLE_PREFIX_CACHE": "false"},
        "services.decode_worker": {"MOEMESH_DECODE_WORKER_ENABLE_PREFIX_CACHE": "false"},
    }
    for module, env in settings.items():
        base.setdefault(module, {}).update(env)
    if src is not None:
        if not (src / "services" / "gateway").is_dir():
            raise ValueError(f"{src}: not a moemesh source tree (no services/gateway)")
        # that tree first, then this process's path less this checkout (on a device, the bundle's packages)
        here = {str(Path.cwd().resolve()), str(Path(__file__).resolve().parents[1])}
        keep = [
            p
            for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and str(Path(p).resolve()) not in here
        ]
        path = os.pathsep.join([str(src.resolve()), *keep])
        for module in SERVICES.values():
            base.setdefault(module, {}).update(PYTHONPATH=path, PYTHONSAFEPATH="1")
    embedded = base.get("services.gateway", {}).pop("MOEMESH_GATEWAY_EMBEDDED_SCHEDULER", "false")
    return MeshConfig(model_dir=model, port=0, extra_env=base, embedded_scheduler=embedded.lower() == "true")


async def one(h: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> float:
    return await first_token_ms(h, url, ttft_body(model, prompt))


async def alternate(a: Mesh, b: Mesh, prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    """Request i to A then B (B then A for odd i), one at a time."""
    ta: list[float] = []
    tb: list[float] = []
    async with httpx.AsyncClient(timeout=60) as h:
        for i, p in enumerate(prompts):
            order = ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta))
            for mesh, out in order:
                out.append(await one(h, mesh.url, mesh.model_name, p))
    return ta, tb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="", help="settings of mesh A (default: none, the defaults)")
    ap.add_argument("--b", required=True, help="settings of mesh B ('' with --a-src/--b-src)")
    ap.add_argument("--requests", type=int, default=200, help="per prompt length and side")
    ap.add_argument("--prompt-lens", default="5,40,200")
    ap.add_argument("--direct-threshold", type=int, default=16, help="scheduler's direct-prefill threshold")
    ap.add_argument("--out", default="bench/results/mesh_ab.json")
    ap.add_argument("--a-src", type=Path, help="source tree of mesh A's services (default: this one)")
    ap.add_argument("--b-src", type=Path, help="source tree of mesh B's services (default: this one)")
    args = ap.parse_args()
    sa, sb = parse_settings(args.a), parse_settings(args.b)
    model = write_tiny_model(Path("/tmp/moemesh-bench-ab"), overwrite=True)
    rec: dict = {"benchmark": "mesh_ab", "machine": platform.node(), "cpus": os.cpu_count(),
                 "command": "python -m bench.mesh_ab " + " ".join(sys.argv[1:]), "a": args.a, "b": args.b,
                 "a_src": str(args.a_src or ""), "b_src": str(args.b_src or ""),
                 "load_avg_before": os.getloadavg(), "rows": []}  # fmt: skip
    with (
        Mesh(mesh_config(model, sa, args.direct_threshold, args.a_src)) as a,
        Mesh(mesh_config(model, sb, args.direct_threshold, args.b_src)) as b,
    ):
        for n in (int(x) for x in args.prompt_lens.split(",")):
            prompts = [prompt_of(n, i) for i in range(args.requests)]
            asyncio.run(alternate(a, b, prompts[:10]))  # warm-up
            ta, tb = asyncio.run(alternate(a, b, prompts))
            diff = [y - x for x, y in zip(ta, tb, strict=True)]
            row: dict[str, Any] = {"prompt_len": n, "a": summary(ta), "b": summary(tb),
                   "b_minus_a_p50_ms": statistics.median(diff), "b_minus_a_mean_ms": statistics.fmean(diff),
                   "b_faster_share": sum(d < 0 for d in diff) / len(diff), "load_avg": os.getloadavg()}  # fmt: skip
            rec["rows"].append(row)
            print(f"{n:4d} tokens  A p50 {row['a']['p50_ms']:6.2f} p99 {row['a']['p99_ms']:6.2f}   "
                  f"B p50 {row['b']['p50_ms']:6.2f} p99 {row['b']['p99_ms']:6.2f}   "
                  f"B-A p50 {row['b_minus_a_p50_ms']:+.2f} ms, B faster in {row['b_faster_share']:.0%}", flush=True)  # fmt: skip
    rec["load_avg_after"] = os.getloadavg()
    print(f"wrote {write_json(args.out, rec)}")


if __name__ == "__main__":
    main()
