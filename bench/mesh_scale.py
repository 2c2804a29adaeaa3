"""The mesh at deployment scale by simulation: N decode + M prefill timing-model workers (libs/sim, hosted
by bench/sim_host.py), the real kv-broker, scheduler, gateway and nats-server as their own processes.

    python -m bench.mesh_scale [--decode 48 --prefill 8 --hosts 8] [--rates 5,10,20,40,80,160,320]
                               [--step-s 8] [--prompt-len 256 --shared 128 --max-tokens 32]
                               [--flood 2000] [--stream-clients 256 --stream-decode 8 --stream-prefill 2]
                               [--gateways 1]

1. Open-loop Poisson load, stepped up until something saturates (under 90% of the requests sent
   complete, the backlog outlives the step by half, or TTFT p50 grows tenfold): after an idle window
   (what liveness alone costs), per step, streamed tokens/s, TTFT p50/p99 minus the modeled prefill (the
   mesh's share, with queueing), scheduler placements/s, bus messages and bytes per request and per
   token net of the idle rate (nats-server /varz), and each process's CPU (cores) from /proc.
2. Scheduler placements: `--flood` submits straight to the scheduler (max_tokens=1, prefix scoring on)
   with every worker and modeled GPUs `--flood-speed` times faster.
3. The gateway streaming test: `--stream-clients` concurrent clients streaming closed-loop against a
   smaller mesh (`--stream-decode` fuller decode workers), so the gateway is what is measured;
   `--gateways N` replicas share its port (their cores are summed, their tokens listed per replica).
Then a projection of gateways and schedulers for 364k tokens/s from the per-core rates. The machine's
load average goes in the JSON (bench/results/mesh_scale.json) with a plot (mesh_scale.png).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

from bench.pyspy import Profile
from bench.scale_load import (
    closed_loop,
    closed_loop_raw,
    counter_total,
    cpu_seconds,
    flood_payloads,
    pct,
    poisson,
    submit_flood,
    submit_flood_lean,
    varz,
)
from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import Mesh, MeshConfig
from libs.launch.supervisor import ServiceSpec
from libs.loadgen.report import write_json
from libs.sim import StepTimeModel
from proto import subjects

TARGET_TOKENS_S = 364_000  # 48 decode GPUs x 7,583 tokens/s (the seed's deployment)
WORKER_MODULES = ("services.prefill_worker", "services.decode_worker")


class ScaleMesh(Mesh):
    """The embedded mesh with its workers hosted `hosts` at a time by bench/sim_host.py."""

    def __init__(self, cfg: MeshConfig, hosts: int, worker_fields: dict) -> None:
        super().__init__(cfg)
        self.hosts, self.worker_fields = hosts, worker_fields

    def specs(self) -> list[ServiceSpec]:
        out = [s for s in super().specs() if s.module not in WORKER_MODULES]
        from proto import messages as m

        dec, pre = self.worker_ids(m.Role.DECODE), self.worker_ids(m.Role.PREFILL)
        fields = {**self.worker_fields, "model_dir": str(Path(self.cfg.model_dir).resolve()),
                  "served_model_name": self.model_name}  # fmt: skip
        for i in range(self.hosts):
            args = ("--decode", ",".join(dec[i :: self.hosts]), "--prefill", ",".join(pre[i :: self.hosts]),
                    "--settings", json.dumps(fields))  # fmt: skip
            out.append(
                ServiceSpec(f"simhost-{i}", "bench.sim_host", {"MOEMESH_NATS_URL": self.nats_url}, args)
            )
        return out

    def pids(self) -> dict[str, int]:
        out = {name: p.proc.pid for name, p in self.sup.procs.items()}
        assert self.nats is not None
        out["nats-server"] = self.nats.proc.pid
        out["bench-client"] = os.getpid()
        return out


class Probe:
    """CPU per process, bus counters and scheduler placements between two points in time."""

    def __init__(self, mesh: ScaleMesh) -> None:
        self.mesh = mesh
        self.t, self.cpu, self.bus, self.placed = self._read()

    def _read(self) -> tuple[float, dict[str, float], dict[str, int], float]:
        assert self.mesh.nats is not None
        cpu = {n: cpu_seconds(p) for n, p in self.mesh.pids().items()}
        placed = counter_total(self.mesh.metrics_url("scheduler"), "moemesh_scheduler_placements_total")
        return time.perf_counter(), cpu, varz(self.mesh.nats.monitor_url), placed

    def delta(self) -> dict:
        t, cpu, bus, placed = self._read()
        dt = t - self.t
        hosts = sum(cpu[n] - self.cpu[n] for n in cpu if n.startswith("simhost"))
        cores = {n: (cpu[n] - self.cpu[n]) / dt for n in cpu if not n.startswith("simhost")}
        cores["sim-workers (all hosts)"] = hosts / dt
        return {"seconds": dt, "cpu_cores": cores, "bus": {k: bus[k] - self.bus[k] for k in bus},
                "placements": placed - self.placed, "placements_per_s": (placed - self.placed) / dt}  # fmt: skip


def per_unit(d: dict, requests: int, tokens: int, idle: dict) -> dict:
    """Bus traffic per request and per token, net of the idle rate (heartbeats, beacons) over the window."""
    net = {k: d["bus"][k] - idle["bus_per_s"][k] * d["seconds"] for k in d["bus"]}
    r, t = max(requests, 1), max(tokens, 1)
    return {
        "msgs_per_request": net["in_msgs"] / r, "bytes_per_request": net["in_bytes"] / r,
        "msgs_per_token": net["in_msgs"] / t, "bytes_per_token": net["in_bytes"] / t,
        "delivered_msgs_per_request": net["out_msgs"] / r, "delivered_bytes_per_request": net["out_bytes"] / r,
    }  # fmt: skip


def idle_window(mesh: ScaleMesh, seconds: float = 3.0) -> dict:
    """The mesh with no requests: the bus and CPU that liveness alone costs."""
    probe = Probe(mesh)
    time.sleep(seconds)  # the measured window itself
    d = probe.delta()
    return {**d, "bus_per_s": {k: v / d["seconds"] for k, v in d["bus"].items()}}


def load_steps(mesh: ScaleMesh, args: argparse.Namespace, prefill_ms: float, idle: dict) -> list[dict]:
    rows: list[dict] = []
    for k, rate in enumerate(float(r) for r in args.rates.split(",") if r.strip()):
        prof = gateway_profile(mesh, args, f"gateway-poisson-{rate:g}rps")
        probe = Probe(mesh)
        res, wall = asyncio.run(poisson(mesh.url, mesh.model_name, rate, args.step_s, args.prompt_len,
                                        args.max_tokens, args.shared, k + 1, args.load_client))  # fmt: skip
        d = probe.delta()
        row = {
            "offered_rps": rate, "client": args.load_client, "sent": res.sent, "completed": res.ok, "failed": res.failed, "wall_s": wall,
            "tokens": res.tokens, "tokens_per_s": res.tokens / wall, "requests_per_s": res.ok / wall,
            "ttft_p50_ms": pct(res.ttft_ms, 50), "ttft_p99_ms": pct(res.ttft_ms, 99),
            "added_ttft_p50_ms": pct(res.ttft_ms, 50) - prefill_ms, "added_ttft_p99_ms": pct(res.ttft_ms, 99) - prefill_ms,
            **d, **per_unit(d, res.ok, res.tokens, idle), "load_avg": os.getloadavg(),
        }  # fmt: skip
        row["busiest"] = max(row["cpu_cores"], key=row["cpu_cores"].get)
        if prof is not None:
            row["profile"] = prof.stop()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("bus",)}), flush=True)
        first_p50 = rows[0]["ttft_p50_ms"]
        # saturated: requests failed, the backlog outlived the step by half, or TTFT grew tenfold
        if res.ok < 0.9 * res.sent or wall > 1.5 * args.step_s or row["ttft_p50_ms"] > 10 * first_p50:
            row["saturated"] = True
            break
    return rows


def gateway_tokens(mesh: ScaleMesh) -> list[float]:
    """Output tokens each gateway replica streamed so far (its own /metrics)."""
    return [counter_total(u, "moemesh_gateway_generation_tokens_total") for u in mesh.gateway_metrics_urls()]


def gateway_profile(mesh: ScaleMesh, args: argparse.Namespace, name: str) -> Profile | None:
    """With --profile DIR: py-spy on the (first) gateway from now until its `stop()`, raw samples in DIR."""
    if not args.profile:
        return None
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    gw = next(pid for n, pid in mesh.pids().items() if n.startswith("gateway"))
    return Profile.start(gw, Path(args.profile) / f"{name}.pyspy.txt")


def streaming_test(mesh: ScaleMesh, args: argparse.Namespace) -> dict:
    prof = gateway_profile(mesh, args, "gateway-streaming")  # while the clients stream
    probe, tokens0 = Probe(mesh), gateway_tokens(mesh)
    loop_fn = closed_loop_raw if args.stream_client == "raw" else closed_loop
    res, wall = asyncio.run(
        loop_fn(mesh.url, mesh.model_name, args.stream_clients, args.stream_tokens, 32, 1)
    )
    d = probe.delta()
    if prof is not None:
        d["profile"] = prof.stop()
    per_gw = [b - a for a, b in zip(tokens0, gateway_tokens(mesh), strict=True)]
    gw = sum(v for k, v in d["cpu_cores"].items() if k == "gateway" or k.startswith("gateway-"))
    out = {"clients": args.stream_clients, "client": args.stream_client, "sim_speed": args.stream_sim_speed or args.sim_speed,
           "gateways": mesh.cfg.gateways, "tokens_per_gateway": per_gw,
           "max_tokens": args.stream_tokens, "completed": res.ok,
           "failed": res.failed, "tokens": res.tokens, "wall_s": wall, "tokens_per_s": res.tokens / wall,
           "gateway_cores": gw, "tokens_per_s_per_gateway_core": res.tokens / wall / max(gw, 1e-9),
           "ttft_p50_ms": pct(res.ttft_ms, 50), **d, "load_avg": os.getloadavg()}  # fmt: skip
    print(json.dumps({k: v for k, v in out.items() if k != "bus"}), flush=True)
    return out


def flood_test(mesh: ScaleMesh, args: argparse.Namespace) -> dict:
    if args.flood_client == "lean":  # Submits encoded before the measured window
        stream = subjects.stream("scale-flood")
        payloads = flood_payloads(mesh.model_name, args.flood, args.prompt_len, stream)
        probe = Probe(mesh)
        res = asyncio.run(submit_flood_lean(mesh.nats_url, payloads, stream, args.flood_in_flight))
    else:
        probe = Probe(mesh)
        res = asyncio.run(
            submit_flood(mesh.nats_url, mesh.model_name, args.flood_in_flight, args.flood, args.prompt_len)
        )
    res["prompt_len"] = args.prompt_len
    d = probe.delta()
    sc = d["cpu_cores"]["scheduler"]
    out = {**res, **d, "placements_per_scheduler_core": d["placements_per_s"] / max(sc, 1e-9),
           "load_avg": os.getloadavg()}  # fmt: skip
    print(json.dumps({k: v for k, v in out.items() if k != "bus"}), flush=True)
    return out


def projection(stream: dict, flood: dict, max_tokens: int) -> dict:
    per_gw = stream["tokens_per_s_per_gateway_core"]
    per_sched = flood["placements_per_scheduler_core"]
    rps = TARGET_TOKENS_S / max_tokens
    return {"target_tokens_per_s": TARGET_TOKENS_S, "tokens_per_request": max_tokens, "requests_per_s": rps,
            "gateway_cores": TARGET_TOKENS_S / per_gw, "scheduler_cores": rps / per_sched,
            "basis": "one busy core per process; tokens/s per gateway core from the streaming test, "
                     "placements per scheduler core from the flood"}  # fmt: skip


def deaths_in_logs(log_dir: Path) -> int:
    """Workers declared dead (or gone) in the services' logs. Nothing is killed here, so every one counted
    before the mesh stops is a false death (a live worker judged silent: its requests fail or move)."""
    pat = re.compile(r"considered dead|missed its heartbeats")
    return sum(len(pat.findall(f.read_text(errors="replace"))) for f in log_dir.glob("*.log"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["offered_rps"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(x, [r["tokens_per_s"] for r in rows], "o-", label="streamed tokens/s")
    a.plot(x, [r["placements_per_s"] * 10 for r in rows], "s--", label="placements/s x10")
    a.set_xlabel("offered requests/s (Poisson)"), a.set_ylabel("rate"), a.legend(), a.grid(alpha=0.3)
    b.plot(x, [r["added_ttft_p50_ms"] for r in rows], "o-", label="p50")
    b.plot(x, [r["added_ttft_p99_ms"] for r in rows], "s--", label="p99")
    b.set_xlabel("offered requests/s (Poisson)"), b.set_ylabel("TTFT minus modeled prefill (ms)")
    b.set_yscale("log"), b.legend(), b.grid(alpha=0.3)
    loads = [x for r in rows for x in r["load_avg"][:1]]
    fig.suptitle(f"moemesh control plane, timing-model workers, {os.cpu_count()} CPUs "
                 f"(load average {min(loads):.0f}-{max(loads):.0f})")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--hosts", type=int, default=8, help="processes hosting the simulated workers")
    ap.add_argument("--rates", default="5,10,20,40,80,160,320", help="Poisson load steps ('': none)")
    ap.add_argument("--step-s", type=float, default=8.0)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--shared", type=int, default=128, help="leading prompt tokens every request shares")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--sim-speed", type=float, default=1.0, help="modeled GPU speed-up (1: H200 as fitted)")
    ap.add_argument(
        "--load-client", choices=["httpx", "raw"], default="httpx",
        help="the Poisson steps' HTTP client (raw: libs.loadgen's lean client, for rates where httpx saturates)",
    )  # fmt: skip
    ap.add_argument("--stream-clients", type=int, default=256)
    ap.add_argument(
        "--stream-client",
        choices=("raw", "httpx"),
        default="httpx",
        help="streaming test load generator: httpx, or a lean raw HTTP/1.1 client (scale_load.RawStream)",
    )
    ap.add_argument(
        "--stream-sim-speed",
        type=float,
        default=0.0,
        help="sim_speed of the streaming test's workers (0: --sim-speed); above 1 they produce tokens "
        "faster than an H200 would, to saturate the gateway",
    )
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--stream-decode", type=int, default=8, help="decode workers in the streaming test")
    ap.add_argument("--stream-prefill", type=int, default=2, help="prefill workers in the streaming test")
    ap.add_argument("--gateways", type=int, default=1, help="gateway processes sharing the API port")
    ap.add_argument("--flood-speed", type=float, default=10.0, help="sim speed during the placement flood")
    ap.add_argument("--flood", type=int, default=2000, help="submits in the placement test (0: skip)")
    ap.add_argument("--flood-in-flight", type=int, default=256)
    ap.add_argument(
        "--flood-client",
        choices=("lean", "bus"),
        default="lean",
        help="flood load generator: pre-encoded submits on the raw NATS client (lean), or Bus.request per "
        "submit with a task each (bus, the load generator of the records before 2026-12-02)",
    )
    ap.add_argument("--flood-hosts", type=int, default=0, help="sim host processes in the flood (0: --hosts)")
    ap.add_argument("--heartbeat-ms", type=int, default=250, help="worker and scheduler heartbeat interval")
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="py-spy on the gateway during each Poisson step and the streaming test; raw files in DIR",
    )
    ap.add_argument("--out", default="bench/results/mesh_scale.json")
    ap.add_argument("--note", default="", help="a line for the record (the machine, what else ran on it)")
    args = ap.parse_args()
    model = write_tiny_model(Path("/tmp/moemesh-bench-tiny"), overwrite=True)
    fields = {"engine": "sim", "transfer_protocol": "skip", "sim_speed": args.sim_speed, "num_pages": 16384,
              "max_num_seqs": 256, "heartbeat_interval_ms": args.heartbeat_ms}  # fmt: skip
    cfg = MeshConfig(model_dir=model, port=0, prefill_workers=args.prefill, decode_workers=args.decode,
                     gateways=args.gateways,
                     log_dir=Path(f"/tmp/moemesh-scale-logs-{os.getpid()}"),
                     extra_env={"services.scheduler": {"MOEMESH_SCHEDULER_MAX_QUEUE": "4096",
                                                       "MOEMESH_SCHEDULER_HEARTBEAT_INTERVAL_MS": str(args.heartbeat_ms)}})  # fmt: skip
    timing = StepTimeModel(speed=args.sim_speed)
    prefill_ms = timing.forward_ms([args.prompt_len - args.shared], [args.prompt_len])
    results: dict = {
        "benchmark": "mesh_scale", "command": "python -m bench.mesh_scale " + shlex.join(sys.argv[1:]),
        "cpus": os.cpu_count(), "load_avg_before": os.getloadavg(), "log_dir": str(cfg.log_dir),
        "machine": platform.node(), "note": args.note,
        "workers": {"decode": args.decode, "prefill": args.prefill, "hosts": args.hosts, **fields},
        "workload": {"prompt_len": args.prompt_len, "shared_prefix": args.shared, "max_tokens": args.max_tokens,
                     "modeled_prefill_ms": prefill_ms},
    }  # fmt: skip
    t0 = time.perf_counter()
    results["steps"], deaths = [], {}
    if args.rates.strip():
        with ScaleMesh(cfg, args.hosts, fields) as mesh:
            results["startup_s"] = time.perf_counter() - t0
            results["idle"] = idle = idle_window(mesh)
            print(
                json.dumps({"idle_bus_per_s": idle["bus_per_s"], "idle_cpu": idle["cpu_cores"]}), flush=True
            )
            results["steps"] = load_steps(mesh, args, prefill_ms, idle)
            deaths["load_steps"] = deaths_in_logs(cfg.log_dir)  # counted before the mesh stops
    seen = deaths_in_logs(cfg.log_dir)  # the logs are appended to: count each phase from here
    if args.flood:  # every worker, fast modeled GPUs: the scheduler is what is measured
        hosts = args.flood_hosts or args.hosts
        with ScaleMesh(cfg, hosts, {**fields, "sim_speed": args.flood_speed}) as mesh:
            idle = idle_window(mesh, 2.0)  # what this mesh costs with no requests, for comparison
            results["placements"] = {**flood_test(mesh, args), "hosts": hosts,
                                     "idle_cpu_cores": idle["cpu_cores"]}  # fmt: skip
            deaths["flood"] = deaths_in_logs(cfg.log_dir) - seen
        seen = deaths_in_logs(cfg.log_dir)
    if args.stream_clients:  # fewer, fuller decode workers: the gateway is what is measured
        small = dataclasses.replace(
            cfg, decode_workers=args.stream_decode, prefill_workers=args.stream_prefill
        )
        speed = {"sim_speed": args.stream_sim_speed} if args.stream_sim_speed else {}
        with ScaleMesh(small, max(1, args.hosts // 4), {**fields, **speed}) as mesh:
            results["streaming"] = streaming_test(mesh, args)
            deaths["streaming"] = deaths_in_logs(cfg.log_dir) - seen
    results["false_deaths"] = deaths
    if args.flood and args.stream_clients:
        results["projection"] = projection(results["streaming"], results["placements"], args.max_tokens)
    results["load_avg_after"] = os.getloadavg()
    out = write_json(args.out, results)
    if results["steps"]:
        try:
            plot(results["steps"], Path(out).with_suffix(".png"))
        except ImportError as e:  # a device machine without matplotlib: the JSON has every number
            print(f"no plot: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
