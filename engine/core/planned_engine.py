"""What every engine whose steps the planner plans (``engine/core/planner.py``) shares: admission, room for a
newcomer, aborts, resets and the KV memory's counters are the planner's, the same for the native batch engine and
the fake one; each runtime runs the plans (``step``) and describes itself. Torch-free."""

from __future__ import annotations

from typing import Any

from engine.core.planner import Planner
from engine.core.seam import InferenceEngine
from engine.core.types import GenerationRequest, MemoryStats


class PlannedEngine(InferenceEngine):
    planner: Planner

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
