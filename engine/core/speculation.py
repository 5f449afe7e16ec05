"""``--speculative auto|ngram|none``: when steps carry drafts (``engine/core/drafter.py``). Torch-free.

A draft of ``k`` tokens adds ``k`` rows to its sequence's step. Whether that pays depends on what an extra row
costs on this CPU: a step's matmuls read every weight once whatever its rows, so while the rows are few an extra
one costs little (here, Sapphire Rapids: 1 row 6.2 ms, 4 rows 7.1 ms), and once the kernel's row tiles fill, each
row costs nearly a token's share of a step (8 rows 13.7 ms, 16 rows 23.4 ms), so a rejected draft token costs
more than an accepted one gains.

- ``ngram``: every decoding sequence drafts (up to ``MAX_DRAFT`` tokens), within the step's token budget;
- ``auto`` (the default): drafts while the step's rows, decoding ones and drafts, stay within ``row_budget``: the
  most rows whose matmuls the start-up probe (``engine/runtime/path_probe.py``) timed at no more than
  ``AUTO_MAX_SLOWDOWN`` times one row's. One stream, or a few, then speculate; a busy batch does not;
- ``none``: no drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.batch_mode import PathTimes

MODES = ("auto", "ngram", "none")
#: ``auto``'s limit: a step with drafts may cost this many times a one-row step's matmuls.
AUTO_MAX_SLOWDOWN = 1.3


@dataclass(slots=True, frozen=True)
class DraftBudget:
    """How many draft rows a step may carry: ``row_budget`` less its decoding rows."""

    mode: str
    row_budget: int

    def __call__(self, decoding: int) -> int:
        return max(0, self.row_budget - decoding)

    def describe(self) -> str:
        if self.mode == "ngram":
            return f"ngram (prompt lookup; drafts within the step's {self.row_budget} tokens)"
        return f"auto (prompt lookup while a step has at most {self.row_budget} rows, drafts included)"


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
    budget = auto_rows(times, invariant)
    return DraftBudget(mode, budget) if budget > 1 else None


def auto_rows(times: PathTimes, invariant: bool) -> int:
    """The most measured rows whose step costs at most ``AUTO_MAX_SLOWDOWN`` times one row's, on the path such a
    step takes (the invariant one, or with invariance off the faster)."""
    pairs = zip(times.invariant, times.dense, strict=True)
    best = list(times.invariant) if invariant else [min(a, b) for a, b in pairs]
    one = best[0] if times.rows[0] == 1 else min(best)
    rows = 1
    for count, seconds in zip(times.rows, best, strict=True):
        if seconds <= AUTO_MAX_SLOWDOWN * one:
            rows = max(rows, count)
    return rows
