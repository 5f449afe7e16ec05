"""Prompt-lookup drafts for speculative decoding (``--speculative``). Torch-free.

A sequence's next tokens are often already in its text: a rewrite, a summary, an extraction or an edit of its
prompt repeats runs of it. ``NgramDrafter`` looks the sequence's last ``n`` tokens up in everything before them
(its prompt and what it generated), longest ``n`` first (``MAX_NGRAM`` down to ``MIN_NGRAM``), and proposes the
tokens that followed their latest earlier occurrence. An index of every n-gram's latest end is kept up to date
as the sequence grows, so a lookup costs a few dict probes, not a scan.

``DraftLength`` sizes each sequence's drafts from its own record: it grows while drafts are accepted whole and
shrinks to what was accepted when one is cut short, between 1 and ``MAX_DRAFT``; after repeated misses the
sequence rests for a few steps (a draft that is rejected costs its rows for nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: The longest and the shortest suffix looked up (tokens).
MAX_NGRAM = 4
MIN_NGRAM = 2
#: Most tokens drafted for one sequence in one step.
MAX_DRAFT = 8
#: A new sequence's first draft length.
FIRST_DRAFT = 4
#: Drafts rejected at their first token in a row before a sequence rests, and the steps it rests.
MISSES_BEFORE_REST = 3
REST_STEPS = 8
#: How much of its record a sequence's acceptance rate keeps at each draft.
RATE_DECAY = 0.8


@dataclass(slots=True)
class NgramDrafter:
    """One sequence's n-gram index over its tokens, and its drafts."""

    #: ``(n-gram) -> position just after its latest occurrence`` for every n-gram that ends before ``indexed``.
    _latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens to follow ``tokens`` (the whole sequence so far), or none when its last n-gram
        (for any n in ``MAX_NGRAM..MIN_NGRAM``) never occurred before."""
        end = len(tokens)
        if limit <= 0 or end <= MIN_NGRAM:
            return []
        self._index(tokens, end - 1)  # n-grams ending before the last position: the suffix itself is not a match
        for n in range(min(MAX_NGRAM, end - 1), MIN_NGRAM - 1, -1):
            after = self._latest.get(tuple(tokens[end - n : end]))
            if after is not None:
                return list(tokens[after : min(after + limit, end)])
        return []

    def _index(self, tokens: Sequence[int], upto: int) -> None:
        """Record the n-grams that end at positions ``indexed..upto-1`` (exclusive end ``upto``)."""
        for stop in range(max(self._indexed, MIN_NGRAM), upto + 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, stop) + 1):
                self._latest[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, upto + 1)


@dataclass(slots=True)
class DraftLength:
    """How many tokens to draft for one sequence next, from how its drafts fared."""

    length: int = FIRST_DRAFT
    misses: int = 0
    resting: int = 0
    #: Totals for this sequence.
    drafted: int = 0
    accepted: int = 0
    #: Recent drafts (each weighing ``RATE_DECAY`` times the next): their first tokens accepted and tried, and their
    #: later tokens accepted and tried (a later token is tried when the one before it was accepted).
    _first: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _later: list[float] = field(default_factory=lambda: [0.0, 0.0])

    @property
    def rates(self) -> tuple[float, float]:
        """How likely its next draft's first token is to be accepted, and each later one given the one before it
        was: its recent record, from even priors (a sequence that has not drafted yet: 0.5 and 0.5). The two
        differ: a draft of a repeated passage, once its first token is right, is mostly right to its end."""
        (first_hits, first_tries), (later_hits, later_tries) = self._first, self._later
        return (first_hits + 1) / (first_tries + 2), (later_hits + 1) / (later_tries + 2)

    def next(self) -> int:
        """The draft length for this step (0 while resting)."""
        if self.resting:
            self.resting -= 1
            return 0
        return self.length

    def record(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens had its first ``accepted`` accepted."""
        self.drafted += drafted
        self.accepted += accepted
        later_tries = min(drafted, accepted + 1) - 1
        for counts, hits, tries in (
            (self._first, min(accepted, 1), 1),
            (self._later, max(accepted - 1, 0), later_tries),
        ):
            counts[0] = RATE_DECAY * counts[0] + hits
            counts[1] = RATE_DECAY * counts[1] + tries
        if accepted == drafted:
            self.length = min(MAX_DRAFT, self.length + 2)
        else:
            self.length = max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= MISSES_BEFORE_REST:
            self.misses, self.resting = 0, REST_STEPS
