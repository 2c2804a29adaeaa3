"""DeepSeek-V3's released layout at reduced width (libs/engine/layout_model.py): the folder's names, dtypes and
163 shards; one EP rank of 32 reads exactly the shared tensors plus its 1/32 of the routed experts (bytes
counted by the loader, checked against the shards' own headers) and opens only the shards holding them;
greedy tokens of EP ranks equal the single process's on the same names with fewer layers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from libs.cli.main import build_parser
from libs.engine import Engine, SamplingParams
from libs.engine.config import ModelConfig
from libs.engine.layout_model import SHARDS, layout_config, shard_name, write_layout_model
from libs.engine.loader import ReadStats
from libs.engine.models.deepseek_v3 import CHECKPOINT_EXPERT_NAME
from libs.engine.presets import deepseek_v3_config
from libs.engine.tiny import weight_shapes
from libs.ep.engine import EPEngine
from libs.ep.loader import load_rank_model
from libs.ep.placement import Placement

N, RANK = 32, 21  # one rank of an EP-32 group (as on four 8-GPU boxes), in the middle of the expert range
MTP = "model.layers.61."


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v3-layout") / "ckpt"
    args = build_parser().parse_args(["tiny-model", "--preset", "v3-layout", "--out", str(out)])
    assert args.func(args) == 0  # `moemesh tiny-model --preset v3-layout`, as a user writes it
    return out


def header_sizes(folder: Path) -> dict[str, tuple[str, int]]:
    """name -> (shard, data bytes), from each shard's safetensors header (not through the loader)."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with open(shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        out.update({n: (shard.name, h["data_offsets"][1] - h["data_offsets"][0]) for n, h in header.items()})
    return out


def test_the_layout_is_deepseek_v3s(layout: Path) -> None:
    index = json.loads((layout / "model.safetensors.index.json").read_text())["weight_map"]
    weights = set(weight_shapes(deepseek_v3_config()))  # the 671B model's names
    scales = {n[: -len("_scale_inv")] for n in index if n.endswith("_scale_inv")}
    assert set(index) - {n + "_scale_inv" for n in scales} == weights and len(index) == 91_991
    assert sorted(set(index.values())) == [shard_name(i) for i in range(SHARDS)]
    assert index["model.embed_tokens.weight"] == "model-00001-of-000163.safetensors"
    assert index[MTP + "eh_proj.weight"] == index[MTP + "shared_head.head.weight"] == shard_name(SHARDS - 1)
    assert all(index[n + "_scale_inv"] == index[n] for n in scales)
    with safe_open(layout / index[MTP + "eh_proj.weight"], "pt") as f:
        assert str(f.get_slice(MTP + "eh_proj.weight").get_dtype()) == "BF16"  # the MTP's eh_proj stays bf16
    name = "model.layers.7.self_attn.kv_b_proj.weight"
    with safe_open(layout / index[name], "pt") as f:
        assert f.get_tensor(name).dtype.itemsize == 1 and f.get_tensor(name + "_scale_inv").dtype.itemsize == 4
    bias = "model.layers.7.mlp.gate.e_score_correction_bias"
    with safe_open(layout / index[bias], "pt") as f:
        assert str(f.get_tensor(bias).dtype) == "torch.float32"
    cfg = json.loads((layout / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"], cfg["n_routed_experts"]) == (61, 1, 256)


def test_a_rank_reads_only_its_experts_and_the_shared_part(layout: Path) -> None:
    cfg = ModelConfig.from_pretrained(layout)
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    placement = Placement.uniform(len(moe), cfg.n_routed_experts, N)
    mine = set(placement.local_experts(RANK)[0].tolist())
    assert len(mine) == cfg.n_routed_experts // N
    sizes = header_sizes(layout)
    experts = shared = own = 0
    shards: set[str] = set()
    for name, (shard, n) in sizes.items():
        if name.startswith(MTP):  # the MTP module: loaded by the MTP engine, not here
            continue
        m = CHECKPOINT_EXPERT_NAME.match(name)
        if m is None:
            shared += n
        else:
            experts += n
            own += n if int(m.group(2)) in mine else 0
        if m is None or int(m.group(2)) in mine:
            shards.add(shard)
    stats = ReadStats()
    load_rank_model(layout, placement, RANK, stats=stats)
    assert own * N == experts  # an even 1/N of every MoE layer's experts
    assert stats.bytes == shared + experts // N
    assert {p.name for p in stats.shards} == shards and shard_name(SHARDS - 1) not in shards
    total = sum(n for _, n in sizes.values())
    print(f"rank {RANK}/{N}: read {stats.bytes} of {total} bytes ({stats.tensors} tensors) from "
          f"{len(stats.shards)} of {SHARDS} shards; shared {shared}, experts {experts // N} of {experts}")  # fmt: skip


def test_ep_ranks_give_the_single_process_greedy_tokens(tmp_path: Path) -> None:
    """The same names and shard rule with 4 layers (3 dense, 1 MoE, the MTP layer after them): a 61-layer
    forward on the CPU would take the suite's budget."""
    path = write_layout_model(tmp_path / "v3-layout-4", layers=4)
    assert re.fullmatch(r"model-\d{5}-of-000163\.safetensors", next(path.glob("*.safetensors")).name)
    assert layout_config(4)["n_routed_experts"] == 256
    prompts = [[(7 * i + n) % 1000 + 3 for i in range(n)] for n in (9, 30)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in Engine.from_pretrained(path, num_pages=32).generate(prompts, greedy)]
    with EPEngine(str(path), ep_size=2, num_pages=32) as ep:
        assert [o.token_ids for o in ep.generate(prompts, greedy)] == want
