"""A real network partition in the mesh (Linux network namespaces, libs.chaos.netns): the prefill worker cut
from the decode worker's Mooncake ports for longer than a KV lease, the bus intact, under streaming load.
Every request finishes with the in-process Engine's greedy text or a retryable error, none hangs, no page
or handle is left once the network heals, and the mesh serves at its earlier rate again. The other
partitions (a decode worker, the gateway or the kv-broker cut from NATS) are bench/partitions.py's."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bench.chaos import reference
from libs.chaos.netns import Network, unavailable
from libs.chaos.partitions import Partition, partition_config, run_partition
from libs.chaos.scenarios import chaos_prompts
from libs.chaos.traffic import Traffic
from libs.launch.mesh import Mesh

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif((why := unavailable()) is not None, reason=f"no network namespaces here: {why}"),
]

LEASE_MS, DEADLINE_S, MAX_TOKENS, FENCE_S = 1500, 30.0, 16, 5.0
# prompts of 17-45 tokens: past the direct-prefill threshold of 16, so each crosses Mooncake
PROMPTS = [p for p in chaos_prompts(40) if len(p) > 16][:12]


def test_prefill_cut_from_the_decode_workers_kv_port_loses_nothing(tiny_model: Path, tmp_path: Path) -> None:
    want = reference(tiny_model, PROMPTS, MAX_TOKENS)
    with Network(("prefill-0", "decode-0")) as net:
        cfg = partition_config(
            tiny_model, tmp_path / "logs", net, password=os.urandom(8).hex(), lease_ms=LEASE_MS,
            deadline_s=DEADLINE_S, workers=1, num_pages=48,
            extra_env={"services.decode_worker": {"MOEMESH_DECODE_WORKER_KV_WRITE_FENCE_S": str(FENCE_S)}},
        )  # fmt: skip
        with Mesh(cfg) as mesh:
            traffic = Traffic(mesh.url, mesh.model_name, PROMPTS, want, MAX_TOKENS, DEADLINE_S + 10)
            part = Partition("prefill-decode", "prefill-0", "decode-0", "the KV path cut, the bus intact")
            r = asyncio.run(
                run_partition(
                    mesh, net, part, traffic, clients=4, window_s=1.5, cut_s=5.0, recover_timeout_s=30.0,
                    leak_timeout_s=LEASE_MS / 1000 + FENCE_S + 10,
                )
            )  # fmt: skip
        decode_log = (mesh.log_dir / "decode-0.log").read_text()
    print(r)
    c = r.counts
    assert c["wrong"] == 0 and c["error"] == 0 and c["hung"] == 0, r  # retryable errors are allowed
    assert c["ok"] > 0, r
    # the cut bit: a write into decode-0 stalled past its lease, or failed midway
    assert "lease expired" in decode_log or "prefill failed" in decode_log, r
    assert r.recovered_s is not None, r
    assert all(v == 0 for v in r.left_on_workers.values()) and r.live_handles == 0, r
