"""Plain values that cross the engine seam. Torch-free, so the scheduler and the HTTP layer can use them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one sequence picks its next token. The default is greedy; the HTTP layer applies the API's own
    defaults (temperature 1)."""

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    seed: int | None = None  # a seeded sequence's draws are keyed by token index, whatever its batchmates do
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: over prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


GREEDY = SamplingParams()


class Constraint(Protocol):
    """What one sequence may generate next (structured output): ``engine/core/grammar.py``'s ``Matcher``."""

    def allowed_tokens(self) -> bytes:
        """A bitmask over the vocabulary: bit ``t % 8`` of byte ``t // 8`` is set when token ``t`` may come next."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past the token generated."""
        ...

    @property
    def is_done(self) -> bool:
        """Nothing more may be generated: the sequence ends (``finish_reason: "stop"``)."""
        ...


@dataclass(slots=True, frozen=True)
class GenerationRequest:
    """What the engine needs to run one sequence: token ids in, a budget, when to stop, how to sample."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    ignore_eos: bool = False
    sampling: SamplingParams = GREEDY
    #: Token ids that end the sequence like EOS does (and are kept in its output).
    stop_token_ids: frozenset[int] = frozenset()
    #: EOS and stop_token_ids are suppressed until this many tokens have been generated.
    min_tokens: int = 0
    #: When set, each generated token comes with its logprob and this many top alternatives.
    logprobs: int | None = None
    #: When set, the prompt's tokens get logprobs too (the first has none), with the first output.
    prompt_logprobs: int | None = None
    #: Special tokens whose spelling stays in the output's text (a tool call's markers); others are left out.
    kept_special: frozenset[int] = frozenset()
    #: When set, every token is one the constraint allows (this sequence's own, mutable state).
    constraint: Constraint | None = field(default=None, compare=False)
    #: vLLM's ``priority``: the waiting queue admits lower values first (arrival order within one); a waiting
    #: sequence that finds no slot or no blocks parks running ones of a higher value (they resume where they stopped).
    priority: int = 0


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, with the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    #: One per token in token_ids, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    #: With a sequence's first token, when the request asked for prompt logprobs: one per prompt token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: Speculative decoding: tokens drafted for this step, and how many of them the model accepted.
    drafted: int = 0
    accepted: int = 0
    #: With a sequence's first token: how many of its prompt tokens came from the prefix cache.
    cached_tokens: int | None = None


@dataclass(slots=True, frozen=True)
class MemoryStats:
    """An engine's KV memory at a glance, for metrics: blocks by state, prefix-cache traffic, preemptions."""

    num_blocks: int
    blocks_in_use: int
    blocks_cached: int
    blocks_free: int
    #: Prompt tokens looked up in the prefix cache, and those found there (counters).
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    #: Speculative decoding: drafts verified, tokens drafted, and those the model accepted (counters).
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: The prefix cache's disk tier (``engine/runtime/kv_disk.py``'s ``describe``): blocks and bytes held, the
    #: bound, prompt tokens found there, blocks restored and the seconds it took, blocks written; None: no tier.
    disk: dict[str, Any] | None = None
