"""``--speculative auto|ngram|none``: which drafts a step carries (``engine/core/drafter.py``). Torch-free.

A draft of ``k`` tokens adds ``k`` rows to its sequence's step. Whether that pays depends on what an extra row costs
on this CPU at the step's size, and on how likely the drafted tokens are to be accepted. A step's matmuls read
every weight once whatever its rows, so while the rows are few an extra one costs little; once the kernel's row
tiles fill, each row costs nearly a token's share of a step, and on CPUs whose dense kernels take over in large
steps (AMX) rows are cheap again there.

- ``ngram``: every decoding sequence drafts as long as its draft length allows, within the step's token budget;
- ``auto`` (the default): a step's drafts are chosen by expected tokens per second. Each sequence's drafted
  tokens are accepted at its own rate so far (``DraftLength.rate``), so the ``j``-th token of its draft adds
  ``rate ** j`` expected tokens; a step of ``R`` rows costs ``T(R)``, the start-up probe's time for the matmuls
  of ``R`` rows on the path such a step takes (``engine/runtime/path_probe.py``). Draft tokens are added most
  likely first while they raise the step's expected tokens per second: ``(E + gain) / T(R + 1) > E / T(R)``.
  One stream on grounded text drafts several tokens; a busy batch drafts only where acceptance is high and rows
  are cheap; free text at a large batch does not draft;
- ``none``: no drafts.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from engine.core.batch_mode import PathTimes

MODES = ("auto", "ngram", "none")


@dataclass(slots=True, frozen=True)
class StepCost:
    """A step's seconds by its rows: the probe's measured row counts, interpolated and extended linearly."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, rows: int) -> float:
        points = list(zip(self.rows, self.seconds, strict=True))
        if len(points) == 1:
            return points[0][1] * max(rows, 1) / points[0][0]
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, s0), (r1, s1) in itertools.pairwise(points):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        (r0, s0), (r1, s1) = points[-2:]
        return s1 + (s1 - s0) / (r1 - r0) * (rows - r1)


@dataclass(slots=True, frozen=True)
class DraftBudget:
    """How many tokens each decoding sequence of a step drafts."""

    mode: str
    #: Most rows a step may carry, decode rows and drafts (the step's token budget).
    step_tokens: int
    #: ``auto``: the step's cost by rows (None for ``ngram``: drafts as long as their sequences allow).
    cost: StepCost | None = None

    def allocate(self, decoding: int, offers: list[tuple[int, float]]) -> list[int]:
        """The draft length for each offer ``(tokens available, acceptance rate)`` in a step with ``decoding``
        decode rows."""
        room = max(0, self.step_tokens - decoding)
        if self.cost is None:
            lengths = []
            for available, _ in offers:
                lengths.append(min(available, room))
                room -= lengths[-1]
            return lengths
        return self._by_expected_speed(decoding, offers, room)

    def _by_expected_speed(self, decoding: int, offers: list[tuple[int, float]], room: int) -> list[int]:
        assert self.cost is not None
        lengths = [0] * len(offers)
        heap = [(-rate, i) for i, (available, rate) in enumerate(offers) if available > 0 and rate > 0]
        heapq.heapify(heap)
        rows, expected = decoding, float(decoding)
        while heap and rows - decoding < room:
            negative_gain, i = heapq.heappop(heap)
            gain = -negative_gain
            if (expected + gain) / self.cost(rows + 1) <= expected / self.cost(rows):
                break  # the likeliest token left does not pay: none after it does
            lengths[i] += 1
            rows, expected = rows + 1, expected + gain
            available, rate = offers[i]
            if lengths[i] < available:
                heapq.heappush(heap, (-(gain * rate), i))
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
