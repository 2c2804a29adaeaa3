import hashlib
import subprocess
import sys
from pathlib import Path

from libs.tokenizer.build import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, VOCAB_SIZE, build_tokenizer

FILES = ("tokenizer.json", "tokenizer_config.json")


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in FILES:
        h.update((folder / name).read_bytes())
    return h.hexdigest()


def test_same_bytes_every_run(tok_dir: Path, tmp_path: Path) -> None:
    assert _digest(build_tokenizer(tmp_path / "again")) == _digest(tok_dir)
    # a fresh interpreter with another hash seed (the Rust trainer uses hash maps too)
    code = f"from libs.tokenizer.build import build_tokenizer; build_tokenizer({str(tmp_path / 'proc')!r})"
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=Path(__file__).parents[3])
    assert _digest(tmp_path / "proc") == _digest(tok_dir)


def test_vocab_layout(tok_dir: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB_SIZE
    assert [tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)] == [0, 1, 2]
    # all 256 byte symbols are in the vocabulary, so any text encodes without unknowns
    assert tok.decode(tok.encode("\x00\x7f\u0800\U0010ffff").ids) == "\x00\x7f\u0800\U0010ffff"
