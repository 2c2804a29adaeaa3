import json
import shutil
from pathlib import Path

import pytest

from libs.tokenizer import Tokenizer
from libs.tokenizer.build import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, USER_TOKEN, VOCAB_SIZE

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x * 2\n",
    "你好，世界！今天天气很好。",
    "emoji 🙂🚀 and ❤️ plus a family 👨‍👩‍👧 and rare CJK 龘",
    "mixed: Grüße, Привет, こんにちは, 12345 and tabs\tand\n\nnewlines",
    f"{USER_TOKEN}hi{ASSISTANT_TOKEN}there",
    "",
]


def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)  # as DeepSeek-V3's config.json says
    assert tok.bos_token == BOS_TOKEN and tok.eos_token == EOS_TOKEN
    assert tok.vocab_size == VOCAB_SIZE
    assert tok.token_to_id(USER_TOKEN) is not None and tok.token_to_id(ASSISTANT_TOKEN) is not None


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    with_bos = tok.encode(text)
    assert with_bos == [tok.bos_token_id, *ids]


def test_multibyte_text_uses_few_tokens_where_trained(tok: Tokenizer) -> None:
    # merges learned from the corpus cover whole CJK words; unseen characters fall back to bytes
    assert len(tok.encode("你好", add_special_tokens=False)) == 1
    assert len(tok.encode("龘", add_special_tokens=False)) == 3


def test_matches_transformers(tok_dir: Path, tok: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        ids = hf.encode(text) + [tok.eos_token_id]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_skip_special_tokens_keeps_role_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(f"{USER_TOKEN}hi{ASSISTANT_TOKEN}ok") + [tok.eos_token_id]
    assert tok.decode(ids) == f"{USER_TOKEN}hi{ASSISTANT_TOKEN}ok"  # DeepSeek marks role tokens non-special
    assert (
        tok.decode(ids, skip_special_tokens=False)
        == f"{BOS_TOKEN}{USER_TOKEN}hi{ASSISTANT_TOKEN}ok{EOS_TOKEN}"
    )


def test_add_bos_and_eos_flags_never_double(tok_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["add_eos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.encode("hello", add_special_tokens=False) == ids[1:-1]


def test_folder_errors(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load .*tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="cannot read .*tokenizer_config.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token '<nope>' is not in the vocabulary"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ValueError, match="syntax error"):
        Tokenizer.from_pretrained(tmp_path)


def test_folder_without_config_still_encodes(tok_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.decode(tok.encode("plain text")) == "plain text"
    assert tok.eos_token_id is None
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_arguments(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="takes a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_never_imports_torch() -> None:
    # the gateway imports this lib and must stay free of torch (and of transformers)
    import subprocess
    import sys

    code = (
        "import sys, libs.tokenizer, libs.tokenizer.build, libs.cli.main as m; m.build_parser(); "
        "bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])


def test_decode_known_of_one_id_is_cached_and_equals_decode(tok: Tokenizer) -> None:
    ids = tok.encode("Hello wörld, 日本語 ok", add_special_tokens=False)
    for skip in (True, False):
        first = [tok.decode_known([i], skip_special_tokens=skip) for i in ids]
        again = [tok.decode_known([i], skip_special_tokens=skip) for i in ids]  # from the cache now
        assert first == again == [tok.decode([i], skip_special_tokens=skip) for i in ids]
    assert tok.decode_known(ids) == tok.decode(ids)  # windows longer than one id go to the decoder


def test_decode_known_of_windows_equals_the_decoder(tok: Tokenizer) -> None:
    """Windows joined from cached single-id texts (ByteLevel) decode exactly as the HF decoder does:
    random ids over the whole vocabulary (special tokens and byte pieces of UTF-8 characters included)
    and windows of real multi-byte text."""
    import random

    rng = random.Random(7)
    text_ids = tok.encode("naïve café, 日本語のテキスト 🙂 ok <|x|> \t\n end", add_special_tokens=False)
    windows = [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(2, 8))] for _ in range(3000)]
    windows += [text_ids[i : i + n] for n in (2, 3, 5) for i in range(len(text_ids) - n + 1)]
    for ids in windows:
        for skip in (True, False):
            assert tok.decode_known(ids, skip_special_tokens=skip) == tok._tok.decode(
                ids, skip_special_tokens=skip
            )
