"""Stop strings over a stream of text deltas. Torch-free.

A stop string can span several tokens and several deltas, so text that could still turn out to be the start
of a stop string is held back; once a stop string appears, the text is cut there (keeping the stop string
only if asked) and nothing after it is ever released.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self._stops = stops
        self._include = include_stop
        self._text = ""
        self._released = 0  # characters of _text already handed out
        self.matched = False

    def feed(self, delta: str, check: bool = True) -> str:
        """Add generated text; return what can be released now. Sets ``matched`` when a stop string appears.

        With ``check`` False (before ``min_tokens``) the text is released as it is, unsearched.
        """
        if self.matched:
            return ""
        # Only the region that could contain a new match is searched: from the held-back tail onwards.
        search_from = max(0, self._released - max((len(s) for s in self._stops), default=0) + 1)
        self._text += delta
        if not check:
            return self._release(len(self._text))
        cut = self._first_stop(search_from)
        if cut is not None:
            self.matched = True
            return self._release(cut)
        return self._release(len(self._text) - self._held_back())

    def flush(self) -> str:
        """The sequence ended without a stop string: release everything held back."""
        return "" if self.matched else self._release(len(self._text))

    def _first_stop(self, start: int) -> int | None:
        best: tuple[int, int] | None = None  # (where the stop string starts, where the kept text ends)
        for stop in self._stops:
            at = self._text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, at + len(stop) if self._include else at)
        return None if best is None else best[1]

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _release(self, end: int) -> str:
        end = max(end, self._released)
        released, self._released = self._text[self._released : end], end
        return released
