"""Soak: the CPU mesh `moemesh up` starts by default (its own option parser and launcher; the tiny model)
under steady load for a long time, with a crash every few minutes, sampling what a slow leak would grow.

    python -m bench.soak [--minutes 30] [--load 0.7] [--fault-every 300] [--sample-every 10]

1. Capacity: requests/s finished (or cancelled as planned) by --clients clients streaming back to back
   the soak's own mix, over the last two thirds of --capacity-seconds.
2. Load: arrivals at --load x capacity (open loop): greedy streams of 24 tokens over a mix of 48 prompts
   (6-150 tokens prefilled on the decode worker, 260-700 through the prefill worker and Mooncake until
   the prefix cache holds them; output checked against the in-process Engine) and, every 4th request, a
   fresh prompt of 260-700 tokens no cache holds (the KV path every time; checked by length); every
   10th is cancelled by the client after 2 chunks.
3. Faults: every --fault-every seconds one service is SIGKILLed (decode worker, prefill worker, kv-broker,
   scheduler, nats-server, gateway, in turn); the launcher restarts it.
4. Samples every --sample-every seconds: RSS per service (and its restart count), request pages, used
   pages and live requests per worker, live and total KV handles at the kv-broker, keys and messages
   (tombstones included) of the JetStream KV buckets; per minute: requests by outcome, TTFT p50/p99.
5. Verdict, after --warmup-minutes: RSS per service flat within its lifetimes (pooled slope, each restart
   its own intercept, the first 2 minutes of a lifetime left out); beside it, not judged, where that growth
   came from: the step each kill left in every other service's RSS and the slope between kills; pages,
   handles and TTFT p99 flat by the median of the run's last third against its first; the JetStream
   buckets' messages (delete markers pile up between the kv-broker's purges, every 300 s, of those older
   than 600 s: a sawtooth) by what each purge leaves, which must not grow, and by purges that keep coming
   (by thirds while fewer than two purges are seen: the first that removes anything comes 10-15 minutes
   after the bucket starts filling); after the load stops, no request page, live request or live handle is
   left. JSON to bench/results/soak-cpu-<minutes>min.json; `--rejudge RECORD` judges a record again.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nats
import nats.js.errors

from bench.chaos import reference
from libs.bus.security import MASK, is_secret, redact_url
from libs.chaos.drift import Judgement, Point, judge_purged, judge_slope, judge_thirds, pooled_slope
from libs.chaos.overload import rss_kib
from libs.chaos.partitions import live_handles
from libs.chaos.traffic import Traffic
from libs.chaos.workers import request_pages, wait_for_no_leaks
from libs.cli import up
from libs.engine.tiny import write_tiny_model
from libs.launch.mesh import NATS, Mesh
from libs.loadgen.report import write_json
from proto import decoder, encode, subjects
from proto import messages as m
from services.kv_broker.store import PURGE_EVERY_S

FAULTS = ("decode-0", "prefill-0", "kv-broker", "scheduler", NATS, "gateway")
BUCKETS = ("moemesh_kv_handles", "moemesh_kv_workers")  # the kv-broker's defaults
MAX_TOKENS = 24
SETTLE_S = 120.0  # a restarted process's first minutes (warm-up allocations) are left out of its RSS fit


def commit() -> str:
    """The source's commit: git's, or a COMMIT file beside a snapshot of the tree (git archive)."""
    r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    if r.returncode == 0:
        return r.stdout.strip()
    return Path("COMMIT").read_text().strip() if Path("COMMIT").is_file() else "unknown"


def soak_prompts(n: int) -> list[list[int]]:
    """n token-id prompts: two in three of 6..150 tokens (prefilled on the decode worker), one in three of
    260..700 (past the scheduler's direct-prefill threshold of 256: the prefill worker and Mooncake); every
    fourth shares the first 32 tokens of the others."""
    out = []
    for i in range(n):
        length = 260 + (i * 53) % 441 if i % 3 == 2 else 6 + (i * 37) % 145
        p = [(13 * i + 7 * k) % 900 + 3 for k in range(length)]
        if i % 4 == 3 and len(p) > 40:
            p[:32] = [(7 * k) % 900 + 3 for k in range(32)]
        out.append(p)
    return out


def fresh_prompt(n: int) -> list[int]:
    """Request n's own prompt of 260..700 tokens, unlike any other (no prefix cache holds it)."""
    rng = random.Random(n)
    return [rng.randrange(3, 1000) for _ in range(rng.randrange(260, 701))]


def mesh_from_up(model: Path, log_dir: Path) -> Mesh:
    """The mesh `moemesh up --model DIR --port 0 --log-dir D` would start, built by up's own code."""
    p = argparse.ArgumentParser()
    up.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["up", "--model", str(model), "--port", "0", "--log-dir", str(log_dir)])
    cfg, _ = up.mesh_config(args, os.environ)
    return Mesh(cfg)


async def jetstream_counts(mesh: Mesh) -> dict[str, dict[str, int]]:
    """Per bucket: live keys, and the messages and bytes its stream holds (delete markers included)."""
    nc = await nats.connect(mesh.nats_url, **mesh.connect_options())
    out: dict[str, dict[str, int]] = {}
    try:
        js = nc.jetstream()
        for b in BUCKETS:
            try:
                kv = await js.key_value(b)
                try:
                    keys = len(await kv.keys())
                except nats.js.errors.NoKeysError:
                    keys = 0
                info = await js.stream_info(f"KV_{b}")
                out[b] = {"keys": keys, "messages": info.state.messages, "bytes": info.state.bytes}
            except (nats.errors.Error, nats.js.errors.Error) as e:
                out[b] = {"error": str(e)}  # type: ignore[dict-item]
    finally:
        await nc.close()
    return out


async def handle_counts(mesh: Mesh) -> dict[str, int]:
    nc = await nats.connect(mesh.nats_url, **mesh.connect_options())
    try:
        r = await nc.request(subjects.BROKER, encode(m.ListHandles()), timeout=5)
        reply = decoder(m.BrokerReply).decode(r.data)
        states = [h.state for h in reply.handles]
        live = sum(s in (m.HandleState.RESERVED, m.HandleState.WRITTEN) for s in states)
        return {"live": live, "records": len(states)}
    except (nats.errors.Error, nats.errors.TimeoutError):
        return {}
    finally:
        await nc.close()


async def sample(mesh: Mesh, t0: float) -> dict[str, Any]:
    workers = [(m.Role.PREFILL, "prefill-0"), (m.Role.DECODE, "decode-0")]
    s: dict[str, Any] = {"t": round(time.monotonic() - t0, 1), "rss_mib": {}, "restarts": {}}
    s["loadavg_1m"] = round(os.getloadavg()[0], 2)  # the machine's load: other jobs show here
    for name, proc in list(mesh.sup.procs.items()):
        rss = rss_kib(proc.proc.pid)[0]
        if rss:  # 0: the process is gone (a fault), not an empty one
            s["rss_mib"][name] = round(rss / 1024, 1)
            s["restarts"][name] = mesh.sup.restarts(name)
    with contextlib.suppress(Exception):  # a service down mid-fault: the sample says so by its absence
        stats = await request_pages(mesh.nats_url, workers, mesh.connect_options())
        s["workers"] = {
            w: {"request_pages": x.request_pages, "used_pages": x.used_pages, "cached_pages": x.cached_pages,
                "live_requests": x.live_requests, "total_pages": x.total_pages}
            for w, x in stats.items()
        }  # fmt: skip
    with contextlib.suppress(Exception):
        s["handles"] = await handle_counts(mesh)
    with contextlib.suppress(Exception):
        s["jetstream"] = await jetstream_counts(mesh)
    return s


async def faults(
    mesh: Mesh, every: float, stop: asyncio.Event, t0: float, log: list[dict], order: Sequence[str] = FAULTS
) -> None:
    for i in range(10**6):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)  # the fault clock, or the end of the run
            return
        name = order[i % len(order)]
        n = mesh.sup.restarts(name)
        t = time.monotonic()
        await asyncio.to_thread(mesh.sup.kill, name)
        try:
            await asyncio.to_thread(mesh.wait_restarted, name, n + 1, 120.0)
            back = round(time.monotonic() - t, 2)
        except TimeoutError as e:
            back = -1.0
            print(f"{name} not back: {e}", flush=True)
        log.append({"t": round(t - t0, 1), "killed": name, "back_s": back})
        print(f"t={t - t0:.0f}s killed {name}; back after {back} s", flush=True)


def shown_setting(env_key: str, value: str) -> str:
    """An inherited MOEMESH_* value as a record may show it: secrets masked, URLs without credentials."""
    name = env_key.lower()
    if is_secret(name):
        return MASK
    return redact_url(value) if name.endswith("url") else value


def per_minute(traffic: Traffic, t0: float, t_end: float) -> list[dict[str, Any]]:
    out = []
    for k in range(int((t_end - t0) // 60) + 1):
        recs = traffic.ended_between(t0 + 60 * k, t0 + 60 * (k + 1))
        ttfts = sorted(r.ttft for r in recs if r.ttft is not None and r.status == "ok")
        row: dict[str, Any] = {"minute": k, **traffic.counts(recs)}
        if ttfts:
            row["ttft_p50_ms"] = round(1000 * statistics.median(ttfts), 1)
            row["ttft_p99_ms"] = round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1)
        out.append(row)
    return out


def rss_stretches(samples: Sequence[dict], faults_log: Sequence[dict], name: str, warmup_s: float) -> list[list[Point]]:
    """A service's RSS samples after warm-up cut into the fault-free stretches between kills (of any service:
    its own kill restarts it), each stretch's first SETTLE_S left out: what a steady leak would grow."""
    kills = sorted(f["t"] for f in faults_log)
    out: dict[int, list[Point]] = {}
    for s in samples:
        i = bisect.bisect_right(kills, s["t"])  # kills at or before this sample
        if s["t"] >= warmup_s and name in s["rss_mib"] and (i == 0 or s["t"] >= kills[i - 1] + SETTLE_S):
            out.setdefault(i, []).append((s["t"], s["rss_mib"][name]))
    return list(out.values())


def rss_steps(samples: Sequence[dict], faults_log: Sequence[dict], warmup_s: float) -> list[dict]:
    """Per kill after warm-up, each service's RSS before it (the last stretch's median) and after it (the next
    stretch's median): the high-water marks the bursts around a fault leave, which stretches do not see."""
    out = []
    names = list(samples[0]["rss_mib"]) if samples else []
    for name in names:
        stretches = rss_stretches(samples, faults_log, name, 0.0)
        for a, b in zip(stretches, stretches[1:], strict=False):
            kill = next((f for f in faults_log if a[-1][0] < f["t"] <= b[0][0]), None)
            if kill is None or kill["t"] < warmup_s or kill["killed"] == name:
                continue  # a restart's step is its own new lifetime, not growth
            step = statistics.median(v for _, v in b) - statistics.median(v for _, v in a)
            out.append({"service": name, "at_kill_of": kill["killed"], "t": kill["t"], "step_mib": round(step, 1)})
    return out


def verdict(
    samples: Sequence[dict], minutes: Sequence[dict], faults_log: Sequence[dict], warmup_s: float,
    purge_every_s: float = PURGE_EVERY_S,
) -> list[Judgement]:  # fmt: skip
    after = [s for s in samples if s["t"] >= warmup_s]
    out = []
    kills: dict[str, list[float]] = {}
    for f in faults_log:
        kills.setdefault(f["killed"], []).append(f["t"])
    for name in after[0]["rss_mib"] if after else []:
        segs: dict[int, list[tuple[float, float]]] = {}
        for s in after:
            restarts = s["restarts"].get(name, 0)
            last_kill = max([t for t in kills.get(name, []) if t <= s["t"]], default=-SETTLE_S)
            if name in s["rss_mib"] and s["t"] >= last_kill + SETTLE_S:
                segs.setdefault(restarts, []).append((s["t"], s["rss_mib"][name]))
        med = statistics.median([v for seg in segs.values() for _, v in seg] or [0.0])
        out.append(judge_slope(f"rss_mib[{name}]", list(segs.values()), per_hour_tol=max(16.0, 0.05 * med)))

    def series(key: str, get: Any) -> list[tuple[float, float]]:
        pts = []
        for s in after:
            with contextlib.suppress(KeyError, TypeError):
                pts.append((s["t"], float(get(s))))
        return pts

    for w in ("prefill-0", "decode-0"):
        out.append(
            judge_thirds(
                f"request_pages[{w}]", series(w, lambda s, w=w: s["workers"][w]["request_pages"]), 0.25, 4
            )
        )
        out.append(
            judge_thirds(f"used_pages[{w}]", series(w, lambda s, w=w: s["workers"][w]["used_pages"]), 0.10, 4)
        )
    out.append(judge_thirds("live_handles", series("h", lambda s: s["handles"]["live"]), 0.25, 4))
    out.append(judge_thirds("handle_records", series("h", lambda s: s["handles"]["records"]), 0.25, 16))
    for b in BUCKETS:  # delete markers pile up between the broker's purges: judged by what each purge leaves
        pts = series(b, lambda s, b=b: s["jetstream"][b]["messages"])
        out.append(judge_purged(f"jetstream_messages[{b}]", pts, purge_every_s, 0.15, 16))
    mins = [
        (60.0 * r["minute"], r["ttft_p99_ms"])
        for r in minutes
        if "ttft_p99_ms" in r and 60 * r["minute"] >= warmup_s
    ]
    out.append(judge_thirds("ttft_p99_ms", mins, 0.5, 20))
    return out  # fmt: skip


async def run(args: argparse.Namespace, mesh: Mesh, prompts: list[list[int]], want: list[list[int]]) -> dict:
    # capacity on the soak's own mix (its fresh prompts from another seed range: still uncached later)
    traffic = Traffic(
        mesh.url, mesh.model_name, prompts, want, MAX_TOKENS, deadline_s=120.0, cancel_every=10,
        fresh_every=4, fresh=lambda n: fresh_prompt(n + 10**7),
    )  # fmt: skip
    stop = asyncio.Event()
    cap_task = asyncio.create_task(traffic.closed_loop(args.clients, stop))
    await asyncio.sleep(args.capacity_seconds / 3)  # warm-up: caches fill, first compiles
    t_cap = time.monotonic()
    await asyncio.sleep(2 * args.capacity_seconds / 3)  # the measurement's length
    done = traffic.ended_between(t_cap, time.monotonic())
    stop.set()
    await cap_task
    capacity = sum(r.status in ("ok", "cancelled") for r in done) / (2 * args.capacity_seconds / 3)
    rate = args.load * capacity
    print(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for {args.minutes} min", flush=True)

    soak = Traffic(
        mesh.url, mesh.model_name, prompts, want, MAX_TOKENS, deadline_s=120.0, cancel_every=10,
        fresh_every=4, fresh=fresh_prompt,
    )  # fmt: skip
    stop = asyncio.Event()
    t0 = time.monotonic()
    samples: list[dict] = []
    faults_log: list[dict] = []
    load = asyncio.create_task(soak.open_loop(rate, stop))
    order = [f for f in args.faults.split(",") if f]
    fault_task = asyncio.create_task(faults(mesh, args.fault_every, stop, t0, faults_log, order))
    end = t0 + 60 * args.minutes
    while time.monotonic() < end:
        samples.append(await sample(mesh, t0))
        s = samples[-1]
        print(
            f"t={s['t']:.0f}s rss={s['rss_mib']} workers={s.get('workers')} handles={s.get('handles')}",
            flush=True,
        )
        await asyncio.sleep(max(0.0, min(args.sample_every, end - time.monotonic())))  # the sampling clock
    stop.set()
    skipped = await load
    await fault_task
    t_end = time.monotonic()
    workers = [(m.Role.PREFILL, "prefill-0"), (m.Role.DECODE, "decode-0")]
    left = await wait_for_no_leaks(mesh.nats_url, workers, 60.0, mesh.connect_options())
    handles_left = await live_handles(mesh, 60.0)
    samples.append(await sample(mesh, t0))
    minutes = per_minute(soak, t0, t_end)
    loads = [s["loadavg_1m"] for s in samples]
    purge_every_s = float(os.environ.get("MOEMESH_KV_BROKER_PURGE_EVERY_S", PURGE_EVERY_S))  # as the broker's
    totals = soak.counts()
    record = {
        "capacity_rps": round(capacity, 2), "offered_rps": round(rate, 2), "arrivals_skipped": skipped,
        "requests": len(soak.records), "outcomes": totals, "faults": faults_log,
        "after_load": {"left_on_workers": left, "live_handles": handles_left},
        "machine_loadavg_1m": {"median": statistics.median(loads), "max": max(loads)} if loads else {},
        "per_minute": minutes, "samples": samples,
    }  # fmt: skip
    return {**record, "verdict": judge_record(record, 60 * args.warmup_minutes, purge_every_s)}


def judge_record(record: dict, warmup_s: float, purge_every_s: float = PURGE_EVERY_S) -> dict:
    """A soak record's verdict from what it measured (samples, per-minute outcomes, faults, what was left)."""
    samples, faults_log, totals = record["samples"], record["faults"], record["outcomes"]
    judged = verdict(samples, record["per_minute"], faults_log, warmup_s, purge_every_s)
    left = record["after_load"]
    final_ok = all(v == 0 for v in left["left_on_workers"].values()) and left["live_handles"] == 0
    flat = final_ok and all(j.flat for j in judged) and not (totals["error"] or totals["hung"] or totals["wrong"])
    between = {}
    for name in samples[0]["rss_mib"] if samples else []:
        slope = pooled_slope(rss_stretches(samples, faults_log, name, warmup_s))
        between[name] = round(slope * 3600, 1) if slope is not None else None
    return {
        "flat": flat, "judgements": [j.as_dict() for j in judged], "nothing_left_after_load": final_ok,
        "rss_steps_at_kills": rss_steps(samples, faults_log, warmup_s), "rss_mib_per_h_between_kills": between,
        "summary": "flat" if flat else "NOT flat: see judgements",
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--load", type=float, default=0.7, help="offered rate as a share of the measured capacity")
    p.add_argument("--fault-every", type=float, default=300.0, help="seconds between kills")
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument("--warmup-minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=8, help="concurrency of the capacity measurement")
    p.add_argument("--capacity-seconds", type=float, default=60.0, help="the first third warms up")
    p.add_argument(
        "--faults", default=",".join(FAULTS), help="the services to SIGKILL, in turn (comma-separated)"
    )
    p.add_argument(
        "--heap-report", action="append", default=[], metavar="SERVICE[:FRAMES]",
        help="log the heap of a kind of service (kv-broker, scheduler, gateway, prefill-worker, decode-worker) "
        "every minute into its log (heap_report_s; FRAMES > 0: traced, heap_report_frames); repeatable",
    )  # fmt: skip
    p.add_argument("--out", default="")
    p.add_argument("--rejudge", metavar="RECORD", help="judge a soak record's samples again with this verdict "
                   "(writes it back with the commit that judged it); runs nothing")  # fmt: skip
    args = p.parse_args(argv)
    if args.rejudge:
        record = json.loads(Path(args.rejudge).read_text())
        record["verdict"] = judge_record(record, 60 * args.warmup_minutes)
        record["verdict"]["judged_at_commit"] = commit()
        write_json(args.rejudge, record)
        report(record)
        return 0
    out = args.out or f"bench/results/soak-cpu-{args.minutes:g}min.json"
    folder = Path(tempfile.mkdtemp(prefix="moemesh-soak-"))
    model = write_tiny_model(folder / "tiny-v3", seed=0)
    prompts = soak_prompts(48)
    want = reference(model, prompts, MAX_TOKENS)
    result: dict[str, Any] = {
        "command": " ".join(  # the MOEMESH_* settings every service inherited from this environment first
            [f"{k}={shlex.quote(shown_setting(k, v))}" for k, v in sorted(os.environ.items()) if k.startswith("MOEMESH_")]
            + [shlex.join(["python", "-m", "bench.soak", *(sys.argv[1:] if argv is None else argv)])]
        ),
        "environment": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                        "commit": commit()},
        "mesh": "moemesh up's default mesh (its parser and launcher): nats-server, kv-broker, scheduler, 1 prefill "
        "+ 1 decode worker, gateway on 127.0.0.1; tiny random model on CPU; every service supervised",
        "traffic": f"open loop at {args.load} x capacity; greedy streams of {MAX_TOKENS} tokens over 48 prompts: "
        "32 of 6-150 tokens, 16 of 260-700 (through the prefill worker and Mooncake), a quarter sharing a "
        "32-token prefix; every 4th request a fresh 260-700-token prompt (uncached: the KV path each time, "
        "checked by length); every 10th cancelled after 2 chunks",
        "leaves_out": "trace spans (no OTLP exporter configured: the SDK is not loaded); GPU workers; EP; "
        "more than one replica per service; hours (run --minutes 480 on a real box)",
    }  # fmt: skip
    for what in args.heap_report:  # the services inherit the environment (a setting of that kind only)
        service, _, frames = what.partition(":")
        prefix = "MOEMESH_" + service.upper().replace("-", "_") + "_"
        os.environ[prefix + "HEAP_REPORT_S"] = "60"
        os.environ[prefix + "HEAP_REPORT_FRAMES"] = frames or "0"
    mesh = mesh_from_up(model, folder / "logs")
    mesh.start(timeout=up.ready_timeout(None, "cpu"))
    try:
        print(f"mesh up ({mesh.url}); logs in {mesh.log_dir}", flush=True)
        result.update(asyncio.run(run(args, mesh, prompts, want)))
    finally:
        mesh.stop()
    print(f"wrote {write_json(out, result)}")
    report(result)
    return 0


def report(record: dict) -> None:
    v = record["verdict"]
    print(f"verdict: {v['summary']}")
    for j in v["judgements"]:
        print(f"  {'ok ' if j['flat'] else 'BAD'} {j['series']}: {j['why']}")
    between = v["rss_mib_per_h_between_kills"]
    print("  RSS slope between kills (MiB/h): " + ", ".join(f"{k} {x:+g}" for k, x in between.items() if x is not None))
    for st in v["rss_steps_at_kills"]:
        if abs(st["step_mib"]) >= 4:
            print(f"  step {st['service']}: {st['step_mib']:+.1f} MiB at the kill of {st['at_kill_of']} (t={st['t']:.0f} s)")


if __name__ == "__main__":
    raise SystemExit(main())
