"""A checkpoint folder's tokenizer: `tokenizer.json` (the `tokenizers` library) plus `tokenizer_config.json`."""

# This lib never imports torch or transformers: the gateway uses it. It reads what transformers reads
# from a Hugging Face folder: the fast tokenizer, the special tokens (plain strings or AddedToken dicts),
# `add_bos_token`/`add_eos_token`, and the chat template (in tokenizer_config.json or, as newer
# transformers saves it, in chat_template.jinja).

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from libs.tokenizer.chat_template import compile_template, render_chat

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token entry {value!r} is neither a string nor an AddedToken dict")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


_ONE_CACHE = 1 << 18  # entries of Tokenizer._one
_CONCAT_MAX = 16  # longest window decode_known joins from single-id texts (the detokenizer's are 2-7)
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """Encode/decode and chat templating for one model; immutable after construction, safe to share."""

    def __init__(self, tokenizer: HFTokenizer, config: Mapping[str, Any] | None = None) -> None:
        self._tok = tokenizer
        self._one: dict[tuple[int, bool], str] = {}  # decode_known of single ids (a pure function)
        # A ByteLevel decoder maps each token to its own bytes and UTF-8-decodes the concatenation, so
        # ids whose texts are each complete (no U+FFFD) decode to the concatenation of those texts.
        self._concat = isinstance(tokenizer.decoder, decoders.ByteLevel)
        config = dict(config or {})
        self.special_tokens: dict[str, str | None] = {k: _token_content(config.get(k)) for k in _SPECIAL_KEYS}
        for key, token in self.special_tokens.items():
            if token is not None and tokenizer.token_to_id(token) is None:
                raise ValueError(f"tokenizer_config.json {key} {token!r} is not in the vocabulary")
        self.chat_template: str | None = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: transformers picks "default"
            named = {t.get("name"): t.get("template") for t in self.chat_template if isinstance(t, Mapping)}
            self.chat_template = named.get("default")
        if self.chat_template is not None:
            compile_template(self.chat_template)  # a broken template fails at load, not at first request
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        self.model_max_length: int | None = config.get("model_max_length")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a checkpoint folder; ValueError naming the folder and file if something is missing or bad."""
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"tokenizer folder {folder} does not exist or is not a directory")
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(
                f"{folder} has no tokenizer.json (a Hugging Face fast-tokenizer file is required; "
                "`moemesh tiny-model --out DIR` writes one)"
            )
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a plain Exception for bad JSON or unknown parts
            raise ValueError(f"cannot load {tok_file}: {e}") from e
        cfg_file = folder / "tokenizer_config.json"
        config = _read_json(cfg_file) if cfg_file.is_file() else {}
        jinja_file = folder / "chat_template.jinja"
        if config.get("chat_template") is None and jinja_file.is_file():
            config["chat_template"] = jinja_file.read_text(encoding="utf-8")
        return cls(tok, config)

    # -- ids of special tokens ------------------------------------------------------------------

    def _id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens["eos_token"]

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (a model's vocab may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def vocab(self) -> dict[str, int]:
        """Every token (added tokens included) as its raw vocabulary string, mapped to its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def backend_json(self) -> str:
        """The tokenizer.json document (grammar engines read its decoder type)."""
        return self._tok.to_str()

    # -- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; with add_special_tokens, BOS/EOS as the folder asks (never doubled)."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            # tokenizer.json may or may not carry a post-processor for what add_bos_token asks.
            bos, eos = self.bos_token_id, self.eos_token_id
            if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
            if self.add_eos_token and eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; bytes of a character split off at the end decode to U+FFFD."""
        n = self.vocab_size
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < n:
                raise ValueError(f"token id {i!r} is out of range for a vocabulary of {n}")
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_known(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`decode` for ids the caller already checked are in range (the streaming detokenizer's hot path,
        twice per token: no per-id check)."""
        # A single id's text is cached; with a ByteLevel decoder a window of ids whose texts are each complete
        # is the concatenation of the cached texts, so the steady state of a stream calls no decoder at all.
        if len(ids) == 1:
            return self._one_text(ids[0], skip_special_tokens)
        if self._concat and len(ids) <= _CONCAT_MAX:
            parts = [self._one_text(i, skip_special_tokens) for i in ids]
            if not any(_REPLACEMENT in p for p in parts):  # a piece of a UTF-8 character: decode for real
                return "".join(parts)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def _one_text(self, token_id: int, skip_special_tokens: bool) -> str:
        key = (token_id, skip_special_tokens)
        if (text := self._one.get(key)) is None:
            if len(self._one) >= _ONE_CACHE:
                self._one.clear()  # bounded; a vocabulary's worth of short strings at most
            text = self._one[key] = self._tok.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, rendered as transformers renders it (tools=, documents= too).
        It already holds BOS when the template writes it: encode it with add_special_tokens=False (or use
        encode_chat)."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)"
            )
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """apply_chat_template then encode without adding special tokens, as transformers' tokenize=True."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)
