"""Chaos on the real mesh (CPU, tiny model): 2 prefill + 2 decode workers, 2 scheduler replicas, the
kv-broker, the gateway and a nats-server requiring a user/password, each its own process. While 64
greedy streaming requests run, one component is killed with SIGKILL (or restarted); every request must
then finish with exactly the text of an undisturbed run (the in-process Engine on the same checkpoint)
or end with a clear error event before its deadline; none hangs; and once traffic stops every live
worker holds no request pages (cached prefix pages aside). The killed service is restarted afterwards,
so the scenarios run in turn on one mesh."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from libs.chaos import FaultResult, gateway_counter, stream_many, summarize, wait_for_no_leaks
from libs.chaos.load import Progress
from libs.chaos.workers import request_pages
from libs.engine import Engine, SamplingParams
from libs.launch.mesh import Mesh, MeshConfig
from libs.launch.natsauth import NatsAuth
from libs.tokenizer import Tokenizer
from proto import messages as m

pytestmark = pytest.mark.e2e

N_REQUESTS, MAX_TOKENS, DEADLINE_S, LEASE_MS = 64, 16, 60.0, 4000
PASSWORD = "chaos-nats-pw-8c1f"
PROMPTS = [[(17 * i + 5 * k) % 900 + 3 for k in range(6 + (i * 7) % 40)] for i in range(N_REQUESTS)]


@pytest.fixture(scope="module")
def chaos_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    cfg = MeshConfig(
        model_dir=tiny_model, port=0, log_dir=tmp_path_factory.mktemp("chaos-logs"), prefill_workers=2,
        decode_workers=2, schedulers=2, nats_auth=NatsAuth(user="moemesh", password=PASSWORD),
        extra_env={
            # prompts of up to 16 tokens are prefilled on the decode worker, longer ones go through Mooncake
            "services.scheduler": {"MOEMESH_SCHEDULER_DIRECT_PREFILL_THRESHOLD": "16",
                                   "MOEMESH_SCHEDULER_LEASE_MS": str(LEASE_MS)},
            # a slower step keeps the streams running long enough to be cut mid-way
            # and a small KV pool (~14 requests per decode worker) keeps requests queued at the schedulers
            "services.decode_worker": {"MOEMESH_DECODE_WORKER_FORWARD_SLEEP_MS": "25",
                                       "MOEMESH_DECODE_WORKER_NUM_PAGES": "48"},
            "services.gateway": {"MOEMESH_GATEWAY_REQUEST_TIMEOUT_S": str(DEADLINE_S),
                                 "MOEMESH_GATEWAY_MAX_MIGRATIONS": "3"},
        },
    )  # fmt: skip
    with Mesh(cfg) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def want(tiny_model: Path) -> list[str]:
    engine = Engine.from_pretrained(tiny_model)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    tok = Tokenizer.from_pretrained(tiny_model)
    return [tok.decode(o.token_ids) for o in outs]


def workers(mesh: Mesh, without: str = "") -> list[tuple[m.Role, str]]:
    return [(r, w) for r in (m.Role.PREFILL, m.Role.DECODE) for w in mesh.worker_ids(r) if w != without]


def run_fault(
    mesh: Mesh, want: list[str], killed: str, strike: Callable[[], None], after: tuple[int, int]
) -> FaultResult:
    """Stream every prompt; once `after` = (requests, chunks each) is reached, `strike()`; then check."""
    migrations = mesh.url + "/metrics"
    before = gateway_counter(migrations, "moemesh_gateway_migrations_total")

    async def fault(progress: Progress) -> None:
        assert await progress.wait(*after, timeout=DEADLINE_S), f"traffic never reached {after}"
        await asyncio.to_thread(strike)

    outcomes, _ = asyncio.run(
        stream_many(mesh.url, mesh.model_name, PROMPTS, MAX_TOKENS, deadline_s=DEADLINE_S, fault=fault)
    )
    live = workers(mesh, without=killed)
    left = asyncio.run(wait_for_no_leaks(mesh.nats_url, live, LEASE_MS / 1000 + 10, mesh.connect_options()))
    assert all(v == 0 for v in left.values()), f"pages or requests left on live workers: {left}"
    migrated = int(gateway_counter(migrations, "moemesh_gateway_migrations_total") - before)
    result = summarize(killed, outcomes, want, MAX_TOKENS, migrated, sum(left.values()))
    assert result.hung == 0 and result.wrong == 0, result
    assert result.completed + result.errors == N_REQUESTS, result
    assert all(msg for msg in result.error_samples), result  # errors say what happened
    print(result)  # the table row, with -s
    return result


def restart(mesh: Mesh, name: str) -> None:
    mesh.sup.start(mesh.sup.procs[name].spec)
    deadline = 60.0

    async def back() -> None:
        async with asyncio.timeout(deadline):
            while True:
                if name in mesh.worker_ids(m.Role.PREFILL) + mesh.worker_ids(m.Role.DECODE):
                    if name in await request_pages(mesh.nats_url, workers(mesh), mesh.connect_options()):
                        return
                elif _healthy(mesh, name):
                    return
                mesh.sup.check_alive()
                await asyncio.sleep(0.2)  # waiting for another process to come up

    asyncio.run(back())


def _healthy(mesh: Mesh, name: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{mesh.http_ports[name]}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def test_kill_a_decode_worker_mid_stream_migrates_its_requests(chaos_mesh: Mesh, want: list[str]) -> None:
    r = run_fault(
        chaos_mesh, want, "decode-0", lambda: chaos_mesh.sup.kill("decode-0"), after=(N_REQUESTS // 2, 3)
    )
    assert r.migrated >= 1 and r.errors == 0 and r.completed == N_REQUESTS, r
    restart(chaos_mesh, "decode-0")


def test_kill_a_prefill_worker(chaos_mesh: Mesh, want: list[str]) -> None:
    r = run_fault(chaos_mesh, want, "prefill-1", lambda: chaos_mesh.sup.kill("prefill-1"), after=(4, 1))
    assert r.errors == 0 and r.completed == N_REQUESTS, r
    restart(chaos_mesh, "prefill-1")


def test_kill_a_scheduler_replica(chaos_mesh: Mesh, want: list[str]) -> None:
    r = run_fault(chaos_mesh, want, "scheduler-0", lambda: chaos_mesh.sup.kill("scheduler-0"), after=(8, 2))
    # the requests queued at the dead replica are re-submitted to the other one
    assert r.migrated >= 1 and r.errors == 0 and r.completed == N_REQUESTS, r
    restart(chaos_mesh, "scheduler-0")


def test_restart_the_kv_broker(chaos_mesh: Mesh, want: list[str]) -> None:
    def strike() -> None:
        chaos_mesh.sup.kill("kv-broker")
        chaos_mesh.sup.start(chaos_mesh.sup.procs["kv-broker"].spec)

    r = run_fault(chaos_mesh, want, "kv-broker", strike, after=(N_REQUESTS // 4, 2))
    assert r.completed + r.errors == N_REQUESTS and r.completed >= N_REQUESTS // 2, r


def test_restart_nats_server_then_new_requests_succeed(chaos_mesh: Mesh, want: list[str]) -> None:
    r = run_fault(chaos_mesh, want, "nats-server", chaos_mesh.restart_nats, after=(N_REQUESTS // 2, 3))
    assert r.completed + r.errors == N_REQUESTS, r
    fresh = asyncio.run(stream_many(chaos_mesh.url, chaos_mesh.model_name, PROMPTS[:8], MAX_TOKENS))[0]
    assert [o.text for o in fresh] == want[:8], [o.error for o in fresh]


def test_no_secret_in_any_log(chaos_mesh: Mesh) -> None:
    logs = list(chaos_mesh.log_dir.glob("*.log"))
    assert len(logs) >= 8
    for log in logs:
        assert PASSWORD not in log.read_text(errors="replace"), log.name
