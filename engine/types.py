"""Plain values that cross the engine seam. Torch-free, so the scheduler and the HTTP layer can use them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one sequence picks its next token. The default is greedy; the HTTP layer applies the API's own
    defaults (temperature 1)."""

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None  # a seeded sequence draws from its own generator, whatever its batchmates do

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


GREEDY = SamplingParams()


@dataclass(slots=True, frozen=True)
class GenerationRequest:
    """What the engine needs to run one sequence: token ids in, a budget, when to stop, how to sample."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    ignore_eos: bool = False
    sampling: SamplingParams = GREEDY


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one sequence.

    A sequence appears in a step's outputs when it produced a token or finished; one whose prompt is still
    being prefilled in chunks produces nothing and does not appear. A finished sequence has already left
    the engine when its output is returned.
    """

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
