"""The seam between the torch-free scheduler and an engine that owns the model and its KV memory."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from engine.core.types import FinishReason, GenerationRequest, MemoryStats, StepOutput


class InferenceEngine(ABC):
    """Iteration-level engine the scheduler pumps, one call at a time from one thread.

    Each decoding sequence advances at least one token per step (more when its drafted tokens are accepted:
    speculative decoding) and leaves the moment it emits a stop token or reaches its own ``max_new_tokens``, so
    each resolves independently of its batchmates. A newcomer's prompt is
    prefilled inside ``step`` (in chunks when it is long), so ``admit`` itself runs no forward.
    """

    #: Most sequences that may be active at once.
    capacity: int
    #: Longest sequence (prompt plus generated tokens) the engine accepts.
    max_model_len: int

    @abstractmethod
    def num_active(self) -> int:
        """Number of sequences admitted and not yet finished or aborted."""

    @abstractmethod
    def can_admit(self, request: GenerationRequest) -> bool:
        """Whether ``request`` fits now, in sequence slots and in KV memory. False means: wait, try later."""

    def make_room(self, request: GenerationRequest) -> bool:
        """``can_admit``, after setting aside (parking) running sequences of a higher ``priority`` value where that
        makes room: they resume, where they stopped, once there is room again. An engine that cannot park only
        answers ``can_admit``."""
        return self.can_admit(request)

    @abstractmethod
    def admit(self, requests: list[GenerationRequest]) -> list[int]:
        """Admit newcomers, returning one seq_id per request in order.

        Atomic: if it raises (``ValueError`` for a request that can never run, such as one longer than
        ``max_model_len``), the active set and KV state are untouched.
        """

    @abstractmethod
    def step(self) -> list[StepOutput]:
        """Advance every decoding sequence by its next token, and any drafted ones it accepts (prefilling
        newcomers first, in chunks); evict finished ones."""

    @abstractmethod
    def abort(self, seq_id: int) -> None:
        """Drop one sequence and free its KV memory. Unknown ids are ignored: it may have just finished."""

    @abstractmethod
    def reset(self) -> None:
        """Drop all active sequences and KV state after a failure; the model survives."""

    def describe_step(self) -> str:
        """What the step being run (or the last one) held, for the log line of a step that failed."""
        return ""

    def memory_stats(self) -> MemoryStats | None:
        """The KV memory's blocks and prefix-cache counters, for metrics; None for an engine without blocks."""
        return None

    def runtime_info(self) -> dict[str, Any]:
        """How the engine computes, for ``/health`` and metrics: its threads (``threads``, ``max_threads`` and
        why, ``threads_reason``), its batch-invariance mode; empty for an engine with nothing to say."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional: an engine may have nothing to finish
        """The engine is done (its model unloaded, the server stopping): finish what it does off its own thread
        (the prefix cache's disk writes). An engine with nothing of the kind need not override it."""

    def release_idle_memory(self) -> None:  # noqa: B027 - optional: an engine may keep nothing for reuse
        """Hand back memory kept for reuse between sequences; called by the scheduler once it has been idle
        for a while. An engine with no such memory need not override it."""


def validate_request(request: GenerationRequest, max_model_len: int, vocab_size: int | None = None) -> None:
    """The checks every engine makes before admitting anything, so that an impossible request fails alone.
    ``vocab_size``: the model's embedding rows (a tokenizer may have more tokens than the model has rows)."""
    if not request.prompt_ids:
        raise ValueError("the prompt is empty")
    if vocab_size is not None and max(request.prompt_ids) >= vocab_size:
        raise ValueError(f"prompt token id {max(request.prompt_ids)} is not in the model's {vocab_size} embeddings")
    if request.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    total = len(request.prompt_ids) + request.max_new_tokens
    if total > max_model_len:
        raise ValueError(
            f"{len(request.prompt_ids)} prompt tokens + {request.max_new_tokens} new tokens exceed the "
            f"maximum context length of {max_model_len}"
        )


def finish_reason(
    request: GenerationRequest, token: int, num_generated: int, eos_token_ids: frozenset[int]
) -> FinishReason | None:
    """Whether the sequence ends with ``token``, its ``num_generated``-th: on EOS or a stop token, when its
    grammar is complete ("stop"), or at its budget ("length"). The constraint has already taken the token."""
    if (token in eos_token_ids and not request.ignore_eos) or token in request.stop_token_ids:
        return "stop"
    if request.constraint is not None and request.constraint.is_done:
        return "stop"
    if num_generated >= request.max_new_tokens:
        return "length"
    return None
