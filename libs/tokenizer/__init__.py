"""Tokenization for moemesh, free of torch: the gateway and the engine share it."""

# `Tokenizer` loads a checkpoint folder's tokenizer files and renders its chat template;
# `IncrementalDetokenizer` turns streamed token ids into text deltas; `StopMatcher` cuts the stream at
# stop strings. `libs.tokenizer.build` makes the tiny tokenizer that tiny checkpoints ship.

from libs.tokenizer.detokenizer import IncrementalDetokenizer
from libs.tokenizer.stop import StopMatcher
from libs.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopMatcher", "Tokenizer"]
