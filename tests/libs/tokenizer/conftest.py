from pathlib import Path

import pytest

from libs.tokenizer import Tokenizer
from libs.tokenizer.build import build_tokenizer


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tok_dir)
