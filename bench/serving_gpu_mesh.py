"""serving_gpu's mesh side: its settings, `moemesh up` as a child process group, greedy token ids through
the gateway, the prefill worker's Mooncake transfer counters and `moemesh bench`'s slow-down experiment."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.pyspy import executable as pyspy_executable
from libs.bus.ports import read_ports
from libs.launch.supervisor import stop_group
from libs.loadgen.slowdown import FULL_BATCH_SHARE
from libs.worker import step_trace

MOEMESH = [sys.executable, "-m", "libs.cli.main"]
BENCH_SEED = 1
PAGE_SIZE = 16


@dataclass(frozen=True)
class Settings:
    device: str
    dtype: str
    concurrency: int
    input_len: int
    output_len: int
    slowdown_ms: float
    max_prefill_tokens: int
    greedy_lens: tuple[int, ...]
    greedy_tokens: int
    deadline: float  # time.monotonic() by which the whole run ends
    engine_reserve_s: float = 150.0  # kept back from the mesh phases for the Engine reference
    gateways: int = 1  # `moemesh up --gateways`: gateway processes on the one API port
    client_procs: int = 1  # `moemesh bench --client-procs`: load-generator processes
    extra_env: dict[str, str] = field(default_factory=dict)  # more MOEMESH_* settings for every service

    def left(self, reserve: float = 0.0) -> float:
        return max(1.0, self.deadline - time.monotonic() - reserve)

    def num_pages(self) -> int:
        """Room for every request's prompt and output, 10% over (the decode worker's and the Engine's)."""
        per_seq = math.ceil((self.input_len + self.output_len + 1) / PAGE_SIZE)
        return math.ceil(1.1 * self.concurrency * per_seq) + 64

    def engine_kwargs(self) -> dict[str, Any]:
        """The reference Engine as the decode worker runs it (its prefill chunked as the prefill worker's)."""
        return {
            "page_size": PAGE_SIZE, "max_num_seqs": self.concurrency, "num_pages": self.num_pages(),
            "max_prefill_tokens": self.max_prefill_tokens,
        }  # fmt: skip

    def env(self, transport: str) -> dict[str, str]:
        n = str(self.concurrency)
        env = {
            "MOEMESH_GATEWAY_ENABLE_ADMIN": "1",  # the slow-down experiment's /admin endpoints
            "MOEMESH_SCHEDULER_LEASE_MS": "300000",  # a full batch of long prompts outlasts the 30 s default
            "MOEMESH_SCHEDULER_QUEUE_TIMEOUT_S": "300",
            "MOEMESH_SCHEDULER_MAX_DECODE_WAITING": n,  # every request placed at once: the batch fills
            "MOEMESH_DECODE_WORKER_MAX_NUM_SEQS": n,
            "MOEMESH_DECODE_WORKER_NUM_PAGES": str(self.num_pages()),
            "MOEMESH_DECODE_WORKER_PAGE_SIZE": str(PAGE_SIZE),
            "MOEMESH_PREFILL_WORKER_PAGE_SIZE": str(PAGE_SIZE),
            "MOEMESH_PREFILL_WORKER_MAX_PREFILL_TOKENS": str(self.max_prefill_tokens),
        }
        if transport == "nvlink_intra":
            env["MC_INTRANODE_NVLINK"] = "1"
        return {**env, **self.extra_env}

    def bench_argv(self, url: str, model_dir: Path, out: Path, seed: int = BENCH_SEED) -> list[str]:
        n = str(self.concurrency)
        return [
            "bench", "--base-url", url, "--tokenizer", str(model_dir), "--num-prompts", n,
            "--random-input-len", str(self.input_len), "--random-output-len", str(self.output_len),
            "--random-range-ratio", "1", "--max-concurrency", n, "--slowdown-ms", f"{self.slowdown_ms:g}",
            "--release-at-batch", n, "--seed", str(seed), "--warmup-requests", "1", "--disable-progress",
            "--output-file", str(out),
        ] + (["--client-procs", str(self.client_procs)] if self.client_procs > 1 else [])  # fmt: skip

    def bench_prompts(self, model_dir: Path, seed: int = BENCH_SEED) -> list[list[int]]:
        """The slow-down run's prompts exactly as `moemesh bench` builds them (its seed + 1)."""
        from libs.cli import bench

        parser = argparse.ArgumentParser()
        bench.add_parser(parser.add_subparsers())
        args = parser.parse_args(self.bench_argv("http://unused", model_dir, Path("unused"), seed))
        reqs = bench.build_requests(argparse.Namespace(**{**vars(args), "seed": args.seed + 1}))
        return [list(r.prompt) for r in reqs]

    def greedy_prompts(self) -> list[list[int]]:
        """Token ids below 1,000 (every tokenizer here has them), one prompt per length."""
        return [[(length + 7 * i) % 1000 + 3 for i in range(length)] for length in self.greedy_lens]


class MeshUpError(RuntimeError):
    """`moemesh up` did not bring the mesh up; the message holds the services' log tails."""


class MeshProcess:
    """`moemesh up` in its own process group, started and stopped by this benchmark."""

    def __init__(self, model_dir: Path, s: Settings, transport: str, log_dir: Path) -> None:
        self.model_dir, self.s, self.transport, self.log_dir = model_dir, s, transport, log_dir
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.model = ""

    @property
    def step_trace(self) -> Path:
        """The decode workers' step timelines: decode-steps-<instance id>.jsonl here (libs/worker/step_trace.py)."""
        return self.log_dir / "decode-steps.jsonl"

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        up_log = self.log_dir / "up.log"
        argv = [
            *MOEMESH, "up", "--model", str(self.model_dir), "--port", "0", "--device", self.s.device,
            "--dtype", self.s.dtype, "--transfer-protocol", self.transport, "--log-dir", str(self.log_dir),
            "--restart-limit", "0",  # a worker that cannot start ends the attempt at once
            "--ready-timeout", f"{self.s.left(self.s.engine_reserve_s):.0f}",  # loading + JIT on a GPU
        ] + (["--gateways", str(self.s.gateways)] if self.s.gateways > 1 else [])  # fmt: skip
        self.proc = subprocess.Popen(
            argv, env={**os.environ, **self.s.env(self.transport), "MOEMESH_DECODE_WORKER_STEP_TRACE": str(self.step_trace)},
            stdout=up_log.open("w"),
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + self.s.left(self.s.engine_reserve_s)
        while (m := re.search(r"moemesh is up: (http://[\d.]+:\d+)", up_log.read_text())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise MeshUpError(f"moemesh up ({self.transport}) did not come up:\n{self.log_tails()}")
            time.sleep(0.5)  # a child process writes the line: nothing to wait on but its log
        self.url = m.group(1)
        gone = re.search(r"given up: ([^(\n]*)", up_log.read_text())  # printed with "moemesh is up"
        if gone is None or gone.group(1).strip() != "none":  # e.g. a prefill worker that failed to start
            raise MeshUpError(f"moemesh up ({self.transport}) lost services:\n{self.log_tails()}")
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as r:
            self.model = json.load(r)["data"][0]["id"]

    def log_tails(self, chars: int = 1500) -> str:
        parts = []
        for log in sorted(self.log_dir.glob("*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def metrics(self, service: str) -> str:
        """A service's /metrics. Its ports file may come a moment after `moemesh up` says the mesh is up (a
        worker heartbeats from its set-up on): waited for, up to 30 s."""
        path = self.log_dir / "ports" / f"{service}.json"
        deadline = time.monotonic() + 30
        while (ports := read_ports(path)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} wrote no ports file ({path}) within 30 s")
            time.sleep(0.05)  # another process writes the file: nothing to wait on but the file
        port = ports["http"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    def gpu_processes(self) -> str:
        """Which processes hold GPU memory (the workers' models and KV pools: --device honoured)."""
        if self.s.device != "cuda":
            return ""
        query = ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"]
        try:
            return subprocess.run(query, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"nvidia-smi: {e}"

    def service_pids(self) -> list[int]:
        """The mesh's service processes (`python -m services.<name>`, children of `moemesh up`, each in a
        session of its own)."""
        if self.proc is None:
            return []
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            ours = self.proc.pid in (int(fields[1]), int(fields[2]))  # the launcher's children (ppid)
            if ours and b"-m" in cmd and any(c.startswith(b"services.") for c in cmd):
                pids.append(int(stat.parent.name))
        return pids

    def service_pid(self, module: str) -> int | None:
        """The first service process running `python -m <module>` (e.g. services.decode_worker)."""
        for pid in self.service_pids():
            with contextlib.suppress(OSError):
                if module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                    return pid
        return None

    def dump_stacks(self, wait_s: float = 5.0) -> int:
        """Ask every service for its threads' Python stacks (SIGUSR1: libs.bus.service registers faulthandler;
        they land in each service's log), before a failed attempt is stopped; -> how many dumped. With py-spy
        at hand, each process's native and Python stacks too (`stacks-<pid>.log` beside the logs): a process
        stuck in a native call that holds the GIL shows where."""
        logs = {p: p.stat().st_size for p in self.log_dir.glob("*.log")}
        pids = self.service_pids()
        native_stacks(pids, self.log_dir)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            grown = [
                p
                for p, n in logs.items()
                if p.stat().st_size > n and "(most recent call first)" in p.read_text(errors="replace")[n:]
            ]
            if len(grown) >= len(pids):
                break
            time.sleep(0.2)  # other processes write the logs: nothing to wait on but the files
        return len(pids)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, signal.SIGINT, 60)  # `moemesh up` drains and stops every service


def native_stacks(pids: list[int], out_dir: Path, timeout_s: float = 20.0) -> list[Path]:
    """`py-spy dump --native` of each process into out_dir/stacks-<pid>.log (its command line first); []
    without py-spy. Failures are written into the file instead of raised: this runs on a failure path."""
    exe = pyspy_executable()
    if exe is None:
        return []
    written = []
    for pid in pids:
        path = out_dir / f"stacks-{pid}.log"
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            done = subprocess.run(
                [exe, "dump", "--native", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            path.write_text(f"{cmd}\n{done.stdout}{done.stderr}")
        except (OSError, subprocess.SubprocessError) as e:
            path.write_text(f"py-spy dump of {pid} failed: {e}\n")
        written.append(path)
    return written


def complete(mesh: MeshProcess, prompt: list[int], max_tokens: int, timeout: float) -> list[int]:
    """A greedy completion's token ids (logprobs name them "token_id:<id>")."""
    body = {
        "model": mesh.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "ignore_eos": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"completion failed: {r.status_code} {r.text[:500]}")
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def greedy_through_mesh(mesh: MeshProcess, s: Settings) -> list[list[int]]:
    return [
        # the workers warmed up (kernels compiled, graphs captured) before the mesh came up
        complete(mesh, p, s.greedy_tokens, min(180.0, s.left(s.engine_reserve_s)))
        for p in s.greedy_prompts()
    ]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def warmup_seconds(mesh: MeshProcess) -> dict[str, float]:
    """Each worker's start-up warm-up (libs/worker/warmup.py), from its /metrics."""
    return {w: _metric(mesh.metrics(w), "moemesh_worker_warmup_seconds") for w in ("prefill-0", "decode-0")}


def engine_calls(mesh: MeshProcess) -> dict[str, dict[str, float]]:
    """Each worker's engine calls so far by where they ran (`loop`: inline on the event loop, a short round
    on an idle worker; `thread`: the engine thread), from its /metrics."""
    out = {}
    for w in ("prefill-0", "decode-0"):
        text = mesh.metrics(w)
        out[w] = {
            on: _metric(text, f'moemesh_worker_engine_calls_total\\{{on="{on}"\\}}')
            for on in ("loop", "thread")
        }
    return out


def decode_counters(mesh: MeshProcess) -> dict[str, float]:
    """decode-0's step histogram and token counter: a difference of two readings says how long its engine
    steps took as the worker saw them (thread hand-off included), to set beside the Engine's step."""
    text = mesh.metrics("decode-0")
    buckets = re.findall(r'^moemesh_decode_step_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)
    return {
        "step_s": _metric(text, "moemesh_decode_step_seconds_sum"),
        "steps": _metric(text, "moemesh_decode_step_seconds_count"),
        "tokens": _metric(text, "moemesh_decode_tokens_total"),
        **{f"le_{le}": float(n) for le, n in buckets},  # cumulative step counts at or under `le` seconds
    }


def decode_worker_full_batch(mesh: MeshProcess, concurrency: int) -> dict[str, Any]:
    """From decode-0's step trace: its own tokens/s and where a step's time went over the full batch after
    the slow-down's release (steps of at least FULL_BATCH_SHARE of the batch), beside what the clients saw."""
    traces = sorted(mesh.step_trace.parent.glob(f"{mesh.step_trace.stem}-*{mesh.step_trace.suffix}"))
    if not traces:
        return {"note": "no step trace written"}
    rows = step_trace.load(traces[0])
    summary = step_trace.full_batch(rows, math.ceil(FULL_BATCH_SHARE * concurrency))
    return summary | {"after_release": step_trace.series(rows)}


def decode_worker_steps(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    steps = after["steps"] - before["steps"]
    return {
        "steps": steps, "tokens": after["tokens"] - before["tokens"],
        "step_ms_mean": 1000 * (after["step_s"] - before["step_s"]) / steps if steps else None,
        "steps_at_or_under_s": {k[3:]: after[k] - before.get(k, 0.0) for k in after if k.startswith("le_")},
    }  # fmt: skip


def transfer_counters(mesh: MeshProcess) -> tuple[float, float, float]:
    text = mesh.metrics("prefill-0")
    return (
        _metric(text, "moemesh_kv_transfer_bytes_total"),
        _metric(text, "moemesh_kv_transfer_seconds_sum"),
        _metric(text, "moemesh_kv_transfer_seconds_count"),
    )


def kv_transfer(mesh: MeshProcess, s: Settings) -> dict[str, Any]:
    """One fresh `input_len` prompt alone (max_tokens 1): the bytes and seconds its KV push added to the
    prefill worker's counters (every layer's latent rows of the prompt's pages, one batch write)."""
    prompt = [(11 * i + 5) % 1000 + 3 for i in range(s.input_len)]  # shares no prefix with the others
    before = transfer_counters(mesh)
    complete(mesh, prompt, 1, min(120.0, s.left(s.engine_reserve_s)))
    deadline = time.monotonic() + 10
    while (after := transfer_counters(mesh))[2] <= before[2]:  # counted right after the write
        if time.monotonic() > deadline:
            raise RuntimeError("the prefill worker counted no KV transfer for the prompt")
        time.sleep(0.05)
    nbytes, seconds = after[0] - before[0], after[1] - before[1]
    return {
        "prompt_tokens": s.input_len, "bytes": int(nbytes), "ms": 1000 * seconds,
        "GBps": nbytes / seconds / 1e9 if seconds > 0 else None, "transport": mesh.transport,
    }  # fmt: skip


def run_slowdown_bench(mesh: MeshProcess, s: Settings, out: Path, seed: int = BENCH_SEED) -> dict[str, Any]:
    """`moemesh bench`'s slow-down experiment against the mesh; its headline numbers (the full file stays
    in the log folder). Another seed draws other prompts (of the same lengths): no prefix-cache hits."""
    argv = [*MOEMESH, *s.bench_argv(mesh.url, mesh.model_dir, out, seed)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=s.left(s.engine_reserve_s))
    if not out.is_file():
        raise RuntimeError(f"moemesh bench wrote no results (rc {done.returncode}): {done.stderr[-2000:]}")
    r = json.loads(out.read_text())
    slowed, base = r["slowdown"], r["baseline"]
    full = slowed["full_batch"]
    return {
        "full_batch_tok_s": r["full_batch_decode_tokens_per_s"],
        "baseline_decode_tok_s": r["baseline_decode_tokens_per_s"],
        "baseline_output_throughput": base["summary"]["output_throughput"],
        "completed": slowed["summary"]["completed"], "failed": slowed["summary"]["failed"],
        "release_reason": slowed["release_reason"], "batch_at_release": slowed["batch_at_release"],
        "peak_batch": slowed["peak_batch"], "finished_before_release": slowed["finished_before_release"],
        "full_batch_window_s": full.get("window_s"), "full_batch_itl_ms": full.get("itl_ms"),
        "ttft_ms": slowed["summary"]["ttft_ms"], "itl_ms": slowed["summary"]["itl_ms"],
        "baseline_ttft_ms": base["summary"]["ttft_ms"], "baseline_itl_ms": base["summary"]["itl_ms"],
        "rc": done.returncode,
    }  # fmt: skip
