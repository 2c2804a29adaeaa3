"""The demo model's text: the pydoc topics every CPython ships (`pydoc_data.topics`, about 465 KB)."""

# The text is split into paragraphs (blank-line separated, topic order, sorted by topic name); every
# `HELD_OUT_EVERY`-th paragraph is held out for the evaluation loss and never trained on, tokenizer
# included. Different Python versions ship slightly different topics, so the corpus digest is part of
# the demo model's cache key.

from __future__ import annotations

import hashlib
from dataclasses import dataclass

HELD_OUT_EVERY = 20


@dataclass(frozen=True)
class Corpus:
    train: list[str]  # paragraphs
    held_out: list[str]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.train, self.held_out):
            h.update("\n\n".join(part).encode())
            h.update(b"\0")
        return h.hexdigest()[:16]


def load_corpus() -> Corpus:
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split the stdlib; pydoc_data is in CPython's own
        raise ValueError(f"the demo model's corpus needs Python's pydoc_data module: {e}") from e

    paragraphs = []
    for name in sorted(topics):
        paragraphs += [p.strip("\n") for p in topics[name].split("\n\n") if p.strip()]
    train = [p for i, p in enumerate(paragraphs) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held_out = [p for i, p in enumerate(paragraphs) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return Corpus(train, held_out)
