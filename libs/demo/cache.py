"""Where the demo model lives: built on first use under ~/.cache/moemesh, reused while its key matches."""

# The key hashes what determines the weights (the corpus, the training settings, the torch version), so
# a changed Python (another pydoc corpus) or a changed recipe builds a new folder instead of serving a
# stale one. The folder is written beside its final name and renamed into place, so an interrupted
# build never leaves a half-written model where `moemesh up` would serve it.

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from libs.demo.pydoc_corpus import load_corpus
from libs.demo.train import TrainSettings, build_demo_model

CACHE_ROOT = Path.home() / ".cache" / "moemesh"
RECIPE_VERSION = 1  # bump when libs/demo changes what a given key would train


def demo_key(settings: TrainSettings) -> str:
    raw = json.dumps(
        [RECIPE_VERSION, load_corpus().digest, asdict(settings), torch.__version__],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def demo_model_dir(settings: TrainSettings | None = None, root: Path | None = None) -> Path:
    return (root or CACHE_ROOT) / f"demo-v3-{demo_key(settings or TrainSettings())}"


def cached_demo_model(settings: TrainSettings | None = None, root: Path | None = None) -> Path | None:
    """The cached demo checkpoint folder, or None when it has not been built for this key."""
    out = demo_model_dir(settings, root)
    return out if (out / "training.json").is_file() else None


def ensure_demo_model(
    settings: TrainSettings | None = None, root: Path | None = None, log: Callable[[str], None] = print
) -> Path:
    """The demo checkpoint folder, trained now (minutes) when it is not cached yet."""
    settings = settings or TrainSettings()
    found = cached_demo_model(settings, root)
    if found is not None:
        return found
    out = demo_model_dir(settings, root)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"training the demo model into {out} (a few minutes on a CPU) ...")
    build_demo_model(tmp, settings, log)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
