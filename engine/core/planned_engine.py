"""The core every planned engine shares (``engine/core/planner.py`` plans its steps): one step is plan -> run ->
commit, and admission, room for a newcomer, aborts, resets, the prefix cache with its tier below memory and the KV
memory's counters are the planner's, the same for the native batch engine, transformers' and the fake one.

A runtime implements only its runner's part: ``run`` (a plan's forward: each sampled sequence's tokens), the hooks
around a step (``before_step``, ``committed``), reading and writing blocks (its ``LowerTier``, handed to the
ledger) and describing itself (``runtime_info``). Torch-free."""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Any

from engine.core.planner import Plan, Planner
from engine.core.seam import InferenceEngine
from engine.core.types import GenerationRequest, MemoryStats, StepOutput, TokenLogprob

#: Each sampled sequence's tokens of a step, with their logprobs (``Planner.commit``'s ``next_tokens``).
StepTokens = list[list[tuple[int, TokenLogprob | None]]]


class PlannedEngine(InferenceEngine):
    planner: Planner
    #: The step being run (or the last one), for ``describe_step``.
    plan_now: Plan | None = None

    def step(self) -> list[StepOutput]:
        """The planner's plan, run by the runtime, its tokens committed by the planner; the blocks the step filled
        go to the tier below memory together (it wakes once a step, not once a block); then the runtime's
        ``committed``."""
        self.before_step()
        started = time.perf_counter()
        plan = self.plan_now = self.planner.plan()
        if plan.empty:
            return []
        outputs = self.planner.commit(plan, self.run(plan))
        if (lower := self.planner.ledger.lower) is not None:
            lower.end_step()
        self.committed(plan, outputs, time.perf_counter() - started)
        return outputs

    @abstractmethod
    def run(self, plan: Plan) -> StepTokens:
        """The plan's forward: each of ``plan.sampled``'s tokens, in order (for a verifying sequence, its draft's
        accepted tokens and the next)."""

    def before_step(self) -> None:
        """Before the planner plans a step (every call of ``step``)."""

    def committed(self, plan: Plan, outputs: list[StepOutput], seconds: float) -> None:
        """After a step's tokens are committed (``seconds``: the step's, from its plan)."""

    @property
    def num_preemptions(self) -> int:
        return self.planner.num_preemptions

    def num_active(self) -> int:
        return len(self.planner.seqs)

    def can_admit(self, request: GenerationRequest) -> bool:
        return self.planner.can_admit(request)

    def make_room(self, request: GenerationRequest) -> bool:
        return self.planner.make_room(request)

    def admit(self, requests: list[GenerationRequest]) -> list[int]:
        return [seq.seq_id for seq in self.planner.admit(requests)]

    def abort(self, seq_id: int) -> None:
        self.planner.abort(seq_id)

    def reset(self) -> None:
        """Drop every sequence and the prefix cache's blocks in memory (a failed step may have left any block
        half-written)."""
        self.planner.reset()

    def memory_stats(self) -> MemoryStats:
        planner = self.planner
        pool = planner.pool
        return MemoryStats(
            pool.num_blocks, pool.num_in_use, pool.num_cached, pool.num_free, pool.queried_tokens, pool.hit_tokens,
            planner.num_preemptions, planner.num_drafts, planner.num_drafted, planner.num_accepted,
            self.disk_stats(),
        )  # fmt: skip

    def disk_stats(self) -> dict[str, Any] | None:
        """The prefix cache's tier below memory, if the engine has one (``MemoryStats.disk``)."""
        return None
