"""bench.kv_tiers' pieces without a mesh: each configuration is a command line `moemesh up` accepts (parsed
and resolved by up's own code), the workload's chats share the system prompt, and percentiles."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import kv_tiers
from libs.cli import up
from libs.engine.tiny import write_tiny_model


def test_each_configuration_is_an_up_command_line_with_its_tiers(tmp_path: Path) -> None:
    a = kv_tiers.parse(["--num-pages", "32", "--host-kv-pages", "256"])
    model = write_tiny_model(tmp_path / "tiny", seed=0)
    p = argparse.ArgumentParser()
    up.add_parser(p.add_subparsers(dest="command"))
    seen = {}
    for name, tiers in kv_tiers.CONFIGS.items():
        cfg, worker = up.mesh_config(p.parse_args(kv_tiers.up_args(a, model, tmp_path, tiers)), {})
        seen[name] = (cfg.kv_store, worker.host_kv_pages, worker.num_pages)
    assert seen == {"off": (False, 0, 32), "host": (False, 256, 32), "host+store": (True, 256, 32)}


def test_chats_share_the_system_prompt_and_turns_are_reproducible() -> None:
    a = kv_tiers.parse(["--sessions", "5", "--system-len", "8", "--user-len", "3"])
    system, first = kv_tiers.chats(a, 100)
    assert len(system) == 8 and len(first) == 5 and all(len(u) == 3 for u in first)
    assert (
        kv_tiers.user_turn(a, 2, 1, 100)
        == kv_tiers.user_turn(a, 2, 1, 100)
        != kv_tiers.user_turn(a, 3, 1, 100)
    )
    assert kv_tiers.pct([1.0, 2.0, 3.0, 4.0], 50) in (2.0, 3.0) and kv_tiers.pct([], 99) is None
