"""Settings through `moemesh up`'s code path to a running decode worker: a config file (up's options and
engine settings at its top level), an env var beating the file and an `up` flag beating both, read back
from the worker's /settings and from its heartbeat (what its engine got)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import nats
import pytest

from libs.cli.main import build_parser
from libs.cli.up import mesh_config
from libs.launch.mesh import Mesh
from proto import decoder, subjects
from proto import messages as m

pytestmark = pytest.mark.e2e

DEADLINE_S = 120.0  # the workers' start (torch import, model load) on a loaded 2-core machine


async def decode_heartbeat(mesh: Mesh) -> m.WorkerHeartbeat:
    hb = decoder(m.Heartbeat)
    got: asyncio.Future[m.WorkerHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_beat(msg) -> None:
        beat = hb.decode(msg.data)
        if isinstance(beat, m.WorkerHeartbeat) and beat.worker_id == "decode-0" and not got.done():
            got.set_result(beat)

    nc = await nats.connect(mesh.nats_url, **mesh.connect_options())
    try:
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
        return await asyncio.wait_for(got, 10)
    finally:
        await nc.close()


async def test_flag_beats_env_beats_file_beats_default_on_a_running_worker(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg_file = tmp_path / "moemesh.yaml"
    cfg_file.write_text(
        "prefill_workers: 0\n"  # up's own option, from the file
        "max_num_seqs: 8\nmax_prefill_tokens: 512\n"  # both workers' engine settings
        "decode-worker:\n  page_size: 32\n"  # one service's section
    )
    monkeypatch.setenv("MOEMESH_DECODE_WORKER_MAX_PREFILL_TOKENS", "256")  # env beats the file
    monkeypatch.setenv("MOEMESH_DECODE_WORKER_MAX_NUM_SEQS", "7")  # ... and the flag beats env
    args = build_parser().parse_args(
        ["up", "--model", str(tiny_model), "--port", "0", "--log-dir", str(tmp_path / "logs"),
         "--config", str(cfg_file), "--max-num-seqs", "5"]
    )  # fmt: skip
    cfg, _ = mesh_config(args, os.environ)
    assert cfg.prefill_workers == 0
    mesh = Mesh(cfg)
    await asyncio.to_thread(mesh.start, DEADLINE_S)
    try:
        side = f"http://{cfg.host}:{mesh.side_port('decode-0')}/settings"
        async with httpx.AsyncClient(timeout=10) as http:
            settings = (await http.get(side)).json()
        assert (settings["max_num_seqs"], settings["max_prefill_tokens"], settings["page_size"]) == (
            5,
            256,
            32,
        )
        assert settings["enable_prefix_cache"] is True  # nothing set it: the default
        beat = await decode_heartbeat(mesh)
        assert (beat.max_running, beat.page_size) == (5, 32)  # the engine's batch cap and page size
    finally:
        await asyncio.to_thread(mesh.stop)
