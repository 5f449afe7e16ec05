"""Stop strings over a stream of text deltas. Torch-free.

A stop string can span several tokens and several deltas, so text that could still turn out to be the start
of a stop string is held back; once a stop string appears, the text is cut there (keeping the stop string
only if asked) and nothing after it is ever released.

All of a sequence's stop strings are matched at once by one automaton (Aho-Corasick) that reads each new character
once: a token costs the same with one stop string or sixty-four, and the automaton's state also says how much of
the text's end could still begin a stop string. The automaton is built once per set of stop strings and shared by
every sequence that uses it.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopAutomaton:
    """The stop strings' trie with failure links. A state is the longest end of the text read so far that begins
    some stop string; ``depth`` is its length, ``found`` the length of the longest stop string it ends with."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.found = [0]
        for stop in stops:
            self._insert(stop)
        self.fail = [0] * len(self.goto)
        self._link()

    def _insert(self, stop: str) -> None:
        state = 0
        for char in stop:
            following = self.goto[state].get(char)
            if following is None:
                following = len(self.goto)
                self.goto[state][char] = following
                self.goto.append({})
                self.depth.append(self.depth[state] + 1)
                self.found.append(0)
            state = following
        self.found[state] = len(stop)

    def _link(self) -> None:
        """Failure links breadth first; a state with no stop string of its own ends with its failure's longest."""
        queue = deque(self.goto[0].values())
        while queue:
            state = queue.popleft()
            for char, following in self.goto[state].items():
                fallback = self.fail[state]
                while fallback and char not in self.goto[fallback]:
                    fallback = self.fail[fallback]
                self.fail[following] = self.goto[fallback].get(char, 0) if state else 0
                if not self.found[following]:
                    self.found[following] = self.found[self.fail[following]]
                queue.append(following)

    def step(self, state: int, char: str) -> int:
        goto, fail = self.goto, self.fail
        while state and char not in goto[state]:
            state = fail[state]
        return goto[state].get(char, 0)


@lru_cache(maxsize=256)
def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """One automaton per set of stop strings (a request's ``n`` sequences, or the same stops sent again)."""
    return StopAutomaton(stops)


class StopMatcher:
    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self._automaton = automaton(stops) if stops else None
        self._include = include_stop
        self._state = 0
        self._pending = ""  # text not released yet: at most the longest stop string, less one character
        self.matched = False

    def feed(self, delta: str, check: bool = True) -> str:
        """Add generated text; return what can be released now. Sets ``matched`` when a stop string appears.

        With ``check`` False (before ``min_tokens``) the text is released as it is: no stop string ending in it
        counts.
        """
        if self.matched:
            return ""
        if self._automaton is None:
            return delta
        offset = len(self._pending)
        self._pending += delta
        cut = self._scan(delta, offset, check)
        if cut is not None:
            self.matched = True
            return self._release(cut)
        if not check:
            return self._release(len(self._pending))
        # What may still begin a stop string is held back (only what is pending: text before min_tokens is out).
        return self._release(max(len(self._pending) - self._automaton.depth[self._state], 0))

    def _scan(self, delta: str, offset: int, check: bool) -> int | None:
        """Reads ``delta`` (at ``offset`` in the pending text) once; where the text is cut if a stop string ends in
        it: before the earliest starting one (after it, with ``include_stop``)."""
        machine, state, best = self._automaton, self._state, None
        assert machine is not None
        for index, char in enumerate(delta):
            state = machine.step(state, char)
            length = machine.found[state] if check else 0
            if length and (best is None or offset + index + 1 - length < best[0]):
                best = (offset + index + 1 - length, offset + index + 1)
        self._state = state
        if best is None:
            return None
        return max(best[1] if self._include else best[0], 0)

    def flush(self) -> str:
        """The sequence ended without a stop string: release everything held back."""
        return "" if self.matched else self._release(len(self._pending))

    def _release(self, end: int) -> str:
        released, self._pending = self._pending[:end], self._pending[end:]
        return released
