"""Structured output with xgrammar: one compiler per engine, one matcher per request, next-token bitmasks
filled on the host and applied on the device (logits_processors.py). JSON is generated compactly (no free
whitespace, as vLLM's `disable_any_whitespace`), so a small model cannot wander in whitespace."""

# xgrammar (vLLM's and SGLang's default backend) over llguidance and outlines-core: prebuilt wheels for
# Python 3.11 CPU machines, JSON schema, regex and EBNF from one API, bitmasks from cached token sets.

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from libs.engine.processing_params import GuidedSpec, choice_grammar
from libs.tokenizer import Tokenizer

_VOCAB_TYPES = {"ByteLevel": xgr.VocabType.BYTE_LEVEL, "ByteFallback": xgr.VocabType.BYTE_FALLBACK}


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the checkpoint's vocabulary; ids past the tokenizer's (model padding) are never
    allowed."""
    backend = json.loads(tokenizer.backend_json())
    decoder = backend.get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
    vocab_type = next((_VOCAB_TYPES[k] for k in kinds if k in _VOCAB_TYPES), xgr.VocabType.RAW)
    encoded = [""] * tokenizer.vocab_size
    for token, i in tokenizer.vocab().items():
        if 0 <= i < len(encoded):
            encoded[i] = token
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=list(eos_ids))


class GrammarBackend:
    """Compiles GuidedSpecs (cached by xgrammar) into per-request matchers and fills their bitmasks."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        if not eos_ids:
            raise ValueError("structured output needs an EOS token id (config.json or the tokenizer)")
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, eos_ids), max_threads=1)
        # a finished grammar (under ignore_eos it can be asked again) allows only EOS
        words = xgr.get_bitmask_shape(1, vocab_size)[1]
        allowed = np.zeros(words * 32, dtype=bool)
        allowed[[e for e in eos_ids if 0 <= e < vocab_size]] = True
        self._eos_only = torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())

    def compile(self, spec: GuidedSpec) -> xgr.CompiledGrammar:
        try:
            match spec.kind:
                case "json":
                    return self.compiler.compile_json_schema(
                        spec.value, any_whitespace=False, strict_mode=True
                    )
                case "json_object":  # any object, as vLLM compiles it (the builtin grammar allows any value)
                    return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                case "regex":
                    return self.compiler.compile_regex(spec.value)
                case "choice":
                    return self.compiler.compile_grammar(choice_grammar(json.loads(spec.value)))
                case _:
                    return self.compiler.compile_grammar(spec.value)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError (and its own types) for bad schemas/grammars
            raise ValueError(f"invalid {spec.kind} for structured output: {e}") from e

    def matcher(self, spec: GuidedSpec) -> Any:
        return xgr.GrammarMatcher(self.compile(spec))

    def fill_bitmask(self, matchers: Sequence[Any], out: torch.Tensor | None = None) -> torch.Tensor:
        """[G, ceil(V/32)] int32 on the host: row g allows what matchers[g] accepts next (a finished
        grammar allows only EOS: under ignore_eos the request goes on to max_tokens). out: a host buffer of
        at least G such rows to fill instead of a new one (pinned, its copy to the GPU is asynchronous)."""
        g = len(matchers)
        bitmask = xgr.allocate_token_bitmask(g, self.vocab_size) if out is None else out[:g]
        for g, matcher in enumerate(matchers):
            if matcher.is_terminated():
                bitmask[g] = self._eos_only
            else:
                matcher.fill_next_token_bitmask(bitmask, g)
        return bitmask
