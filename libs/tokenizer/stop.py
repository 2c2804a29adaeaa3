"""Stop strings matched on streamed text, with hold-back."""

# Text that could be the start of a stop string is held back until the next delta decides it: either
# the stop string completes (the stream ends there and the stop string is cut, unless asked to keep
# it) or it does not (the held text is released). Every text the matcher returns is therefore final.
# Invariant: the held text is the longest suffix of the text seen that is a proper prefix of some stop
# string, so a match can never start inside text already returned.

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """Feed detokenized deltas in order; one instance per request."""

    def __init__(self, stop: Iterable[str], include_stop_str: bool = False) -> None:
        stops = list(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._stops = tuple(dict.fromkeys(stops))
        self._include = include_stop_str
        self._held = ""
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that ended the stream, once one has

    @property
    def held(self) -> str:
        """Text seen but not yet returned (it might begin a stop string)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text to emit now, whether a stop string was hit); after a hit, always ("", True)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.stopped, self.stop_str, self._held = True, stop, ""
            return text[: start + len(stop)] if self._include else text[:start], True
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At the end of the stream (for another reason than a stop string): release the held text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """Earliest stop string in text; of two starting at the same place, the longer."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = text.find(stop)
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(stop) > len(best[1]))):
                best = (i, stop)
        return best

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
