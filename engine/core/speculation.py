"""``--speculative auto|ngram|none``: which drafts a step carries (``engine/core/drafter.py``). Torch-free.

A draft of ``k`` tokens adds ``k`` rows to its sequence's step. Whether that pays depends on what an extra row costs
on this CPU at the step's size, and on how likely the drafted tokens are to be accepted. A step's matmuls read
every weight once whatever its rows, so while the rows are few an extra one costs little; once the kernel's row
tiles fill, each row costs nearly a token's share of a step, and on CPUs whose dense kernels take over in large
steps (AMX) rows are cheap again there.

- ``ngram``: every decoding sequence drafts as long as its draft length allows, within the step's token budget;
- ``auto`` (the default): a step's drafts are chosen by expected tokens per second. Each sequence's drafts are
  accepted at its own rates so far (``DraftLength.rates``): a draft's first token at one, each later token (the
  one before it accepted) at another, so the ``j``-th token of its draft adds ``first * later ** (j - 1)``
  expected tokens; a step of ``R`` rows costs ``T(R) + F + c R``: ``T`` the start-up probe's time for
  the matmuls of ``R`` rows on the path such a step takes (``engine/runtime/path_probe.py``), ``F + c R`` what
  recent decoding steps took beyond it (attention, sampling, bookkeeping: ``StepOverhead``, fitted as they run).
  Draft tokens are taken most likely first, and the step keeps as many of them as gives the highest expected
  tokens per second, ``E / cost(R)``.
  One stream on grounded text drafts several tokens; a busy batch drafts only where acceptance is high and rows
  are cheap; free text at a large batch does not draft;
- ``none``: no drafts.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from engine.core.batch_mode import PathTimes

MODES = ("auto", "ngram", "none")
#: ``auto`` stops looking at longer drafts once a step's expected speed is this far below the best so far.
GIVE_UP = 0.8
#: ``auto`` drafts only where the step's expected speed beats no drafts by this much: near the break-even the
#: estimates' error decides, and work outside the step's forward (lookups, commits) is not in them.
MIN_GAIN = 0.03


@dataclass(slots=True, frozen=True)
class StepCost:
    """A step's seconds by its rows: the probe's measured row counts, interpolated and extended linearly."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, rows: int) -> float:
        known, seconds = self.rows, self.seconds
        if len(known) == 1:
            return seconds[0] * max(rows, 1) / known[0]
        if rows <= known[0]:
            return seconds[0]
        # The measured pair around ``rows``, or the last two (extended linearly past the largest).
        right = min(bisect.bisect_left(known, rows), len(known) - 1)
        r0, r1, s0, s1 = known[right - 1], known[right], seconds[right - 1], seconds[right]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)


@dataclass(slots=True)
class StepOverhead:
    """What a step of ``R`` rows takes beyond the probe's matmuls, ``F + c R``: a least-squares line through recent
    decoding steps' excess (each weighing ``DECAY`` times the next). Attention, sampling and bookkeeping grow with
    the rows, which the probe leaves out: at 32 streams a step took ~45 ms where its matmuls took 28. While the
    steps' rows barely vary the excess counts as fixed (``c`` = 0) until drafts vary them."""

    DECAY = 0.97
    weight: float = 0.0
    _sums: list[float] = field(default_factory=lambda: [0.0] * 4)  # rows, excess, rows^2, rows * excess
    #: The fitted line ``(F, c)``, made once after each observation (a step's allocation asks it many times).
    _line: tuple[float, float] = (0.0, 0.0)

    def observe(self, rows: int, excess: float) -> None:
        self.weight = self.DECAY * self.weight + 1
        for i, value in enumerate((rows, excess, rows * rows, rows * excess)):
            self._sums[i] = self.DECAY * self._sums[i] + value
        mean_rows, mean_excess, mean_square, mean_product = (total / self.weight for total in self._sums)
        spread = mean_square - mean_rows**2
        slope = max(0.0, (mean_product - mean_rows * mean_excess) / spread) if spread > 0.25 else 0.0
        self._line = (mean_excess - slope * mean_rows, slope)

    def __call__(self, rows: int) -> float:
        fixed, per_row = self._line
        return max(0.0, fixed + per_row * rows)


@dataclass(slots=True, frozen=True)
class DraftBudget:
    """How many tokens each decoding sequence of a step drafts."""

    mode: str
    #: Most rows a step may carry, decode rows and drafts (the step's token budget).
    step_tokens: int
    #: ``auto``: the step's matmuls' cost by rows (None for ``ngram``: drafts as long as their sequences allow).
    cost: StepCost | None = None
    #: ``auto``: what steps take beyond those matmuls, as measured (``observe``).
    overhead: StepOverhead = field(default_factory=StepOverhead)

    def observe(self, rows: int, seconds: float) -> None:
        """A decoding step (no prompt rows) of ``rows`` rows took ``seconds``, from its plan to its commit."""
        if self.cost is not None:
            self.overhead.observe(rows, seconds - self.cost(rows))

    def step_seconds(self, rows: int) -> float:
        """What a decoding step of ``rows`` rows is expected to take (``auto``)."""
        assert self.cost is not None
        return self.cost(rows) + self.overhead(rows)

    def allocate(self, decoding: int, offers: list[tuple[int, float, float]]) -> list[int]:
        """The draft length for each offer ``(tokens available, first token's acceptance rate, later tokens')``
        in a step with ``decoding`` decode rows."""
        room = max(0, self.step_tokens - decoding)
        if self.cost is None:
            lengths = []
            for available, _, _ in offers:
                lengths.append(min(available, room))
                room -= lengths[-1]
            return lengths
        return self._by_expected_speed(decoding, offers, room)

    def _by_expected_speed(self, decoding: int, offers: list[tuple[int, float, float]], room: int) -> list[int]:
        """Draft tokens likeliest first; the step keeps as many of them as gives the most expected tokens per
        second. (Not just while each one pays on its own: a step's cost rises in jumps where the kernel's row
        tiles fill, and a token past a jump may not pay alone where the few after it make it pay.)"""
        heap = [(-first, i) for i, (available, first, _) in enumerate(offers) if available > 0 and first > 0]
        heapq.heapify(heap)
        order: list[int] = []
        taken = [0] * len(offers)
        expected = float(decoding)
        best, best_speed = 0, expected / self.step_seconds(decoding)
        expected_without = best_speed
        while heap and len(order) < room:
            negative_gain, i = heapq.heappop(heap)
            order.append(i)
            taken[i] += 1
            expected -= negative_gain
            speed = expected / self.step_seconds(decoding + len(order))
            if speed > best_speed:
                best, best_speed = len(order), speed
            elif speed < GIVE_UP * best_speed:
                break  # the gains only shrink from here: no later count catches up
            available, _, later = offers[i]
            if taken[i] < available:
                heapq.heappush(heap, (negative_gain * later, i))
        lengths = [0] * len(offers)
        if best_speed < (1 + MIN_GAIN) * expected_without:
            return lengths
        for i in order[:best]:
            lengths[i] += 1
        return lengths

    def describe(self) -> str:
        if self.cost is None:
            return f"ngram (prompt lookup; every sequence drafts, within the step's {self.step_tokens} tokens)"
        return "auto (prompt lookup; drafts while they raise the step's expected tokens per second)"


def choose(mode: str, times: PathTimes | None, invariant: bool, step_tokens: int) -> DraftBudget | None:
    """The budget for ``--speculative mode`` given the probe's ``times`` (None: no probe, as for a model the lean
    runner does not run), whether steps keep the invariant path, and the step's token budget; None: no drafts."""
    if mode not in MODES:
        raise ValueError(f"--speculative must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "none":
        return None
    if mode == "ngram":
        return DraftBudget(mode, step_tokens)
    if times is None:
        return None
    return DraftBudget(mode, step_tokens, step_cost(times, invariant))


def step_cost(times: PathTimes, invariant: bool) -> StepCost:
    """A step's cost by rows on the path it takes: the invariant one, or with invariance off the faster."""
    pairs = zip(times.invariant, times.dense, strict=True)
    best = times.invariant if invariant else tuple(min(a, b) for a, b in pairs)
    return StepCost(times.rows, tuple(best))
