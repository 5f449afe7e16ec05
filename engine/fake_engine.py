"""A deterministic, torch-free engine with the real engine's lifecycle, for scheduler and HTTP tests."""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.base import InferenceEngine, finish_reason, validate_request
from engine.block_pool import prefix_hashes
from engine.tokenizer import ByteTokenizer
from engine.types import Constraint, GenerationRequest, MemoryStats, StepOutput

_ALPHABET = b"abcdefghijklmnopqrstuvwxyz"
_BLOCK = 16


@dataclass(slots=True)
class _FakeSeq:
    request: GenerationRequest
    num_generated: int = 0
    cached_tokens: int = 0


class FakeEngine(InferenceEngine):
    """Generates the letters a, b, c, ... cyclically; one token per sequence per step.

    Like HFEngine, ``admit`` runs nothing: a newcomer's first token comes from the next ``step`` (its
    prefill), and a sequence leaves in the step that produces its last token. ``eos_after`` makes every
    sequence emit the end-of-sequence token as its n-th token; ``fail_on_step`` makes the n-th step raise,
    to test the scheduler's recovery; ``step_delay`` makes each step take that long, like a real forward.
    It remembers the hashes of the prompts' full 16-token blocks, as a prefix cache would (never evicting),
    to report cached prompt tokens.
    """

    def __init__(
        self,
        capacity: int = 8,
        max_model_len: int = 256,
        eos_after: int | None = None,
        step_delay: float = 0.0,
    ) -> None:
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.eos_after = eos_after
        self.step_delay = step_delay
        self.num_tokens = 0
        self.fail_on_step: int | None = None
        self.num_steps = 0
        self._active: dict[int, _FakeSeq] = {}
        self._next_seq_id = 0
        self._cached_blocks: set[bytes] = set()
        self._queried = self._hit = 0

    def num_active(self) -> int:
        return len(self._active)

    def can_admit(self, request: GenerationRequest) -> bool:
        return len(self._active) < self.capacity

    def admit(self, requests: list[GenerationRequest]) -> list[int]:
        if len(self._active) + len(requests) > self.capacity:
            raise RuntimeError(f"admit of {len(requests)} would exceed capacity {self.capacity}")
        for request in requests:
            validate_request(request, self.max_model_len)
        seq_ids = list(range(self._next_seq_id, self._next_seq_id + len(requests)))
        self._next_seq_id += len(requests)
        self._active.update(
            (sid, _FakeSeq(req, 0, self._take_prefix(req))) for sid, req in zip(seq_ids, requests, strict=True)
        )
        return seq_ids

    def _take_prefix(self, request: GenerationRequest) -> int:
        """Prompt tokens a prefix cache would give (all but the last at most), remembering the prompt's blocks."""
        prompt = request.prompt_ids
        hashes = prefix_hashes(prompt[: len(prompt) - 1], _BLOCK)
        hit = next((i for i, digest in enumerate(hashes) if digest not in self._cached_blocks), len(hashes))
        self._cached_blocks.update(prefix_hashes(prompt, _BLOCK))
        self._queried += len(prompt)
        self._hit += hit * _BLOCK
        return hit * _BLOCK

    def memory_stats(self) -> MemoryStats:
        cached = len(self._cached_blocks)
        return MemoryStats(cached, 0, cached, 0, self._queried, self._hit, 0)

    def step(self) -> list[StepOutput]:
        self.num_steps += 1
        if self.fail_on_step == self.num_steps:
            raise RuntimeError(f"injected engine fault at step {self.num_steps}")
        if self.step_delay and self._active:
            time.sleep(self.step_delay)
        outputs = [self._advance(seq_id, seq) for seq_id, seq in self._active.items()]
        self.num_tokens += len(outputs)
        for out in outputs:
            if out.finish_reason is not None:
                del self._active[out.seq_id]
        return outputs

    def abort(self, seq_id: int) -> None:
        self._active.pop(seq_id, None)

    def reset(self) -> None:
        self._active = {}

    def _advance(self, seq_id: int, seq: _FakeSeq) -> StepOutput:
        seq.num_generated += 1
        n = seq.num_generated
        token = ByteTokenizer.EOS if n == self.eos_after else _ALPHABET[(n - 1) % len(_ALPHABET)]
        constraint = seq.request.constraint
        if constraint is not None:
            token = _allowed_token(constraint, token)
            constraint.accept(token)
        out = StepOutput(seq_id, [token], finish_reason(seq.request, token, n, frozenset({ByteTokenizer.EOS})))
        if n == 1:
            out.cached_tokens = seq.cached_tokens
        return out


def _allowed_token(constraint: Constraint, wanted: int) -> int:
    """``wanted`` if the constraint allows it, else the allowed token of the highest id (which, for JSON over
    bytes, closes objects and strings: ``}`` and ``"`` sort above the other punctuation)."""
    mask = constraint.allowed_tokens()
    allowed = [t for t in range(len(mask) * 8) if mask[t // 8] >> (t % 8) & 1]
    return wanted if wanted in allowed else max(allowed)
