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
#: How much of its record a sequence's acceptance rates keep at each draft, and the population's.
RATE_DECAY = 0.8
POPULATION_DECAY = 0.98
#: How many tries the population's rates count for in a sequence's.
PRIOR_WEIGHT = 2.0


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
class DraftRecord:
    """Drafts' first tokens accepted and tried, and their later tokens accepted and tried (a later token is tried
    when the one before it was accepted); each draft weighs ``decay`` times the next."""

    decay: float
    first: list[float] = field(default_factory=lambda: [0.0, 0.0])
    later: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def add(self, drafted: int, accepted: int) -> None:
        later = (max(accepted - 1, 0), min(drafted, accepted + 1) - 1)
        for counts, (hits, tries) in ((self.first, (min(accepted, 1), 1)), (self.later, later)):
            counts[0] = self.decay * counts[0] + hits
            counts[1] = self.decay * counts[1] + tries

    def rates(self, prior: tuple[float, float], weight: float) -> tuple[float, float]:
        """Both acceptance rates, from ``prior`` counted as ``weight`` tries of each."""
        (first_hits, first_tries), (later_hits, later_tries) = self.first, self.later
        return (
            (first_hits + weight * prior[0]) / (first_tries + weight),
            (later_hits + weight * prior[1]) / (later_tries + weight),
        )


@dataclass(slots=True)
class DraftLength:
    """How many tokens to draft for one sequence next, from how its drafts fared."""

    length: int = FIRST_DRAFT
    misses: int = 0
    resting: int = 0
    #: Totals for this sequence.
    drafted: int = 0
    accepted: int = 0
    #: This sequence's recent drafts, and (shared by a planner's sequences) everyone's: the prior of its rates.
    own: DraftRecord = field(default_factory=lambda: DraftRecord(RATE_DECAY))
    population: DraftRecord | None = None

    @property
    def rates(self) -> tuple[float, float]:
        """How likely its next draft's first token is to be accepted, and each later one given the one before it
        was: its recent record, from the population's rates (``PRIOR_WEIGHT`` drafts' worth; even rates where
        there is none). The two differ: a draft of a repeated passage, once its first token is right, is mostly
        right to its end; and a new sequence starts from what drafts have done lately, not from a guess."""
        prior = (0.5, 0.5) if self.population is None else self.population.rates((0.5, 0.5), PRIOR_WEIGHT)
        return self.own.rates(prior, PRIOR_WEIGHT)

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
        for record in (self.own, self.population):
            if record is not None:
                record.add(drafted, accepted)
        if accepted == drafted:
            self.length = min(MAX_DRAFT, self.length + 2)
        else:
            self.length = max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= MISSES_BEFORE_REST:
            self.misses, self.resting = 0, REST_STEPS
