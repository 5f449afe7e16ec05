"""A deterministic, torch-free engine with the real engine's lifecycle and plan, for scheduler and HTTP tests."""

from __future__ import annotations

import time
from typing import Any

from engine.core.block_pool import BlockPool
from engine.core.blocks import BlockLedger
from engine.core.config import BLOCK_SIZE
from engine.core.planned_engine import PlannedEngine, StepTokens
from engine.core.planner import Plan, Planner
from engine.core.speculation import DraftBudget
from engine.core.tokenizer import ByteTokenizer
from engine.core.types import Constraint, StepOutput

_ALPHABET = b"abcdefghijklmnopqrstuvwxyz"


class FakeEngine(PlannedEngine):
    """Generates the letters a, b, c, ... cyclically; one token per sequence per step.

    Planned by the real engine's planner (``engine/core/planner.py``) over a pool of blocks with no tensors: a
    newcomer's first token comes from the next ``step`` (its prefill), a sequence leaves in the step that produces
    its last token, and finished sequences' full blocks stay in the prefix cache, so cached prompt tokens are
    reported as the real engine reports them. Its step budget and pool hold every slot's longest sequence, so a
    prompt prefills in one step and nothing is preempted. ``eos_after`` makes every sequence emit the
    end-of-sequence token as its n-th token; ``fail_on_step`` makes the n-th step raise, to test the scheduler's
    recovery; ``step_delay`` makes each step take that long, like a real forward. ``speculative``: sequences draft
    from their text (``engine/core/drafter.py``) and the alphabet accepts what it would have written, so that a
    step may give a sequence several tokens, as the real engine's speculative decoding does.
    """

    def __init__(
        self,
        capacity: int = 8,
        max_model_len: int = 256,
        eos_after: int | None = None,
        step_delay: float = 0.0,
        speculative: bool = False,
    ) -> None:
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.eos_after = eos_after
        self.step_delay = step_delay
        self.num_tokens = 0
        self.fail_on_step: int | None = None
        self.num_steps = 0
        num_blocks = 2 * capacity * -(-max_model_len // BLOCK_SIZE)
        self.planner = Planner(
            BlockLedger(BlockPool(num_blocks, BLOCK_SIZE), capacity),
            capacity=capacity,
            max_model_len=max_model_len,
            max_num_batched_tokens=capacity * max_model_len,
            eos_token_ids=frozenset({ByteTokenizer.EOS}),
            draft_rows=DraftBudget("ngram", max_model_len) if speculative else None,
        )

    def before_step(self) -> None:
        self.num_steps += 1
        if self.fail_on_step == self.num_steps:
            raise RuntimeError(f"injected engine fault at step {self.num_steps}")

    def run(self, plan: Plan) -> StepTokens:
        if self.step_delay:
            time.sleep(self.step_delay)
        return self._tokens(plan)

    def committed(self, plan: Plan, outputs: list[StepOutput], seconds: float) -> None:
        self.num_tokens += sum(len(out.token_ids) for out in outputs)

    def runtime_info(self) -> dict[str, Any]:
        pool = self.planner.pool
        return {
            "weights": "none (the fake engine writes the alphabet)",
            "kv_cache": {"blocks": pool.num_blocks, "block_size": pool.block_size,
                         "tokens": pool.num_blocks * pool.block_size, "bytes": 0, "dtype": "none"},
            "max_batch_size": self.capacity, "max_num_batched_tokens": self.planner.max_num_batched_tokens,
            "max_model_len": self.max_model_len, "prefix_caching": True,
            "speculative": "none" if (drafts := self.planner.draft_rows) is None else drafts.describe(),
        }  # fmt: skip

    def describe_step(self) -> str:
        return f"fake step {self.num_steps}"

    def _tokens(self, plan: Plan) -> StepTokens:
        """The next letter of each sampled sequence (or EOS as its ``eos_after``-th), as its grammar allows; for
        a verifying one, its draft's letters while they are the ones it would write, then the next."""
        tokens: StepTokens = []
        for seq in plan.sampled:
            picked = []
            for i in range(len(seq.draft) + 1):
                token = self._letter(len(seq.output_ids) + i + 1)
                if seq.request.constraint is not None:
                    token = _allowed_token(seq.request.constraint, token)
                picked.append((token, None))
                if i == len(seq.draft) or token != seq.draft[i]:
                    break
            tokens.append(picked)
        return tokens

    def _letter(self, n: int) -> int:
        """A sequence's ``n``-th token."""
        return ByteTokenizer.EOS if n == self.eos_after else _ALPHABET[(n - 1) % len(_ALPHABET)]


def _allowed_token(constraint: Constraint, wanted: int) -> int:
    """``wanted`` if the constraint allows it, else the allowed token of the highest id (which, for JSON over
    bytes, closes objects and strings: ``}`` and ``"`` sort above the other punctuation)."""
    mask = constraint.allowed_tokens()
    allowed = [t for t in range(len(mask) * 8) if mask[t // 8] >> (t % 8) & 1]
    return wanted if wanted in allowed else max(allowed)
