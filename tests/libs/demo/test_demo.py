"""The demo model's recipe (libs/demo): a briefly trained checkpoint loads in the engine and in
transformers with the training model's logits (main head and MTP module), and the cache builds once."""

from __future__ import annotations

import json

import pytest
import torch

from libs.demo.cache import cached_demo_model, ensure_demo_model
from libs.demo.model import DemoDeepseekV3
from libs.demo.pydoc_corpus import load_corpus
from libs.demo.train import build_demo_model, quick_settings
from libs.engine.config import ModelConfig
from libs.engine.runner import Chunk
from libs.engine.speculative import MTPEngine
from libs.tokenizer import Tokenizer
from tests.libs.engine.hf_utils import hf_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    settings = quick_settings(steps=5)
    build_demo_model(out, settings, log=lambda _: None)
    return out, settings


def test_corpus_split_is_disjoint_and_stable():
    a, b = load_corpus(), load_corpus()
    assert a.digest == b.digest
    assert 15 * len(a.held_out) < len(a.train) < 25 * len(a.held_out)
    assert sum(map(len, a.train)) > 300_000  # CPython's pydoc topics are ~465 KB


def test_checkpoint_matches_transformers_and_training_model(trained):
    path, settings = trained
    ids = Tokenizer.from_pretrained(path).encode("A list is a mutable sequence of objects.")
    engine = MTPEngine.load(path, mtp_k=1)
    pages = engine._alloc(4)
    chunk = Chunk(ids, 0, pages)
    hidden = engine._target([chunk])
    ours = engine.model.compute_logits(hidden)
    ours_mtp = engine.mtp.compute_logits(engine._mtp_forward([Chunk(ids[1:], 0, pages)], hidden[:-1]))
    with torch.no_grad():
        theirs = hf_model(path)(torch.tensor([ids])).logits[0]
        # the training model, rebuilt from the saved tensors
        twin = DemoDeepseekV3(ModelConfig.from_pretrained(path))
        _load_twin(twin, path)
        main, mtp = twin(torch.tensor([ids]))
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    assert torch.allclose(ours, main[0], atol=1e-4), (ours - main[0]).abs().max()
    assert mtp is not None and torch.allclose(ours_mtp, mtp[0], atol=1e-4), (ours_mtp - mtp[0]).abs().max()
    metrics = json.loads((path / "training.json").read_text())
    assert metrics["held_out"]["loss"] > 0 and metrics["settings"]["steps"] == settings.steps


def _load_twin(twin: DemoDeepseekV3, path) -> None:
    from safetensors.torch import load_file

    twin.load_state_dict_hf(load_file(str(path / "model.safetensors")))


def test_cache_builds_once(tmp_path):
    settings = quick_settings(steps=2)
    assert cached_demo_model(settings, root=tmp_path) is None
    lines: list[str] = []
    first = ensure_demo_model(settings, root=tmp_path, log=lines.append)
    assert lines and (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    assert not list(tmp_path.glob("*.partial"))
    again: list[str] = []
    assert ensure_demo_model(settings, root=tmp_path, log=again.append) == first and not again
    assert cached_demo_model(quick_settings(steps=3), root=tmp_path) is None  # another recipe, another key


def test_up_serves_the_demo_model_only_once_it_is_cached(tmp_path, monkeypatch):
    """`moemesh up` without --model: the tiny model on a fresh machine (ready in seconds), the demo
    model once `moemesh demo-model` has cached it; --model tiny/demo/DIR choose explicitly."""
    from libs.cli import up
    from libs.demo import cache

    monkeypatch.setattr(cache, "CACHE_ROOT", tmp_path)
    monkeypatch.setattr(up, "DEFAULT_TINY", tmp_path / "tiny-v3")
    assert up._choose_model(None) == tmp_path / "tiny-v3"
    assert (tmp_path / "tiny-v3" / "config.json").is_file()
    demo = cache.demo_model_dir()
    demo.mkdir()
    (demo / "training.json").write_text("{}")  # what a finished build leaves last
    assert up._choose_model(None) == demo and up._default_name(demo) == "demo-v3"
    assert up._choose_model("tiny") == tmp_path / "tiny-v3"
    assert up._choose_model("demo") == demo
    assert up._choose_model(str(tmp_path / "x")) == tmp_path / "x"
