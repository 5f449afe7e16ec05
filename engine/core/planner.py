"""Who runs in each step, and what a step's tokens do to the sequences: the planning half of continuous batching.

Memory. Sequences hold blocks of a pool (``engine/core/block_pool.py``) through a ledger
(``engine/core/blocks.py``). A sequence takes blocks as it grows and returns them when it leaves, so admission asks
only for room for a newcomer's prompt (plus a small headroom), not for everything it might generate.

A step. Every decoding sequence contributes one row; prefilling sequences (FIFO) then get chunks of their prompt
within the step's token budget (``max_num_batched_tokens``, less the decode rows, but never under
``MIN_PREFILL_BUDGET``, so a full batch of decodes cannot starve newcomers).

Preemption. When a decoding sequence needs a block and the pool has none, the most recently admitted sequence
is preempted: its blocks are released (its full ones stay in the prefix cache) and it goes back to the head of
the prefill queue. Readmitted, it recomputes its prompt and the tokens it produced (from the prefix cache where
they are still there); the last row of that recompute yields its next token, and its stream goes on with no
token repeated or lost. Its sampling state (seeded generator, grammar, penalties) is its own and goes on too.

Prefix caching. A newcomer first takes the longest cached prefix of its prompt and prefills only the rest; at
least its last prompt token is always computed, for the logits of its first token. Requests for prompt logprobs
bypass the cache: every prompt row is computed and scored.

The runtime (``engine/runtime/batch_engine.py``) carries a plan out: it packs the rows, runs the forward, samples,
and hands the tokens back to ``commit``. The fake engine (``engine/core/fake_engine.py``) is planned by the same
planner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.core.block_pool import BlockPool
from engine.core.blocks import BlockLedger, SeqBlocks
from engine.core.seam import finish_reason, validate_request
from engine.core.types import GenerationRequest, StepOutput, TokenLogprob

#: Prompt rows a step always has room for, however many sequences decode.
MIN_PREFILL_BUDGET = 16


@dataclass(slots=True)
class PrefillChunk:
    """Rows ``row : row + length`` of the step's packed input are positions ``start : start + length`` of one
    sequence (its prompt, or on readmission after a preemption its prompt and what it generated)."""

    row: int
    start: int
    length: int


@dataclass(slots=True, eq=False)
class Seq:
    seq_id: int
    request: GenerationRequest
    blocks: SeqBlocks
    output_ids: list[int] = field(default_factory=list)
    #: Positions whose K/V its blocks hold.
    num_computed: int = 0
    #: Positions to compute before it samples: its prompt, or after a preemption its prompt and its output.
    target: int = 0
    #: Whether this (re)admission has looked in the prefix cache yet.
    matched: bool = False
    #: Prompt tokens the prefix cache gave it at its first admission (reported in usage).
    cached_tokens: int = 0
    #: The runtime's sampling state for a seeded request (a generator), kept across preemptions.
    generator: Any = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled chunk by chunk when asked for

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    def token_at(self, position: int) -> int:
        prompt = self.request.prompt_ids
        return prompt[position] if position < len(prompt) else self.output_ids[position - len(prompt)]

    def tokens(self, end: int) -> list[int]:
        return [*self.request.prompt_ids, *self.output_ids][:end]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt rows are scored: prompt logprobs were asked for and its first token is not out yet."""
        return self.prompt_logprobs is not None and not self.output_ids


@dataclass(slots=True)
class Plan:
    """Who runs in one step: every decoding sequence, then chunks of prefilling ones."""

    decoding: list[Seq]
    chunks: list[tuple[Seq, PrefillChunk]]
    #: Sequences whose prefill ends in this step, with their chunk: its last row yields their next token.
    completing: list[tuple[Seq, PrefillChunk]]

    @property
    def empty(self) -> bool:
        return not self.decoding and not self.chunks

    @property
    def sampled(self) -> list[Seq]:
        """The sequences that get a token this step, in the order of the logits' rows."""
        return self.decoding + [seq for seq, _ in self.completing]

    @property
    def num_rows(self) -> int:
        return len(self.decoding) + sum(chunk.length for _, chunk in self.chunks)

    def describe(self) -> str:
        decoding = [f"seq {s.seq_id}: prompt {s.prompt_len}, position {s.num_computed}" for s in self.decoding]
        chunks = [
            f"seq {s.seq_id}: prompt {s.prompt_len}, rows {c.row}..{c.row + c.length - 1} = positions "
            f"{c.start}..{c.start + c.length - 1}{' (completes)' if c.start + c.length == s.target else ''}"
            for s, c in self.chunks
        ]
        return (
            f"{self.num_rows} rows ({len(self.decoding)} decoding, {len(self.chunks)} prompt chunks); "
            f"decoding [{'; '.join(decoding)}]; chunks [{'; '.join(chunks)}]"
        )


class Planner:
    """Admission by sequence slots and blocks, the plan of each step, preemption, and the commit of its tokens."""

    def __init__(
        self,
        ledger: BlockLedger,
        *,
        capacity: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        eos_token_ids: frozenset[int],
        copy_block: Callable[[int, int], None] = lambda src, dst: None,
    ) -> None:
        """``copy_block(src, dst)`` copies one block's K/V, for a cached prefix shared only in part."""
        self.ledger = ledger
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self._copy_block = copy_block
        # Blocks kept free at admission, for the decoding sequences that will cross into a new block.
        self._headroom = 1 + ledger.pool.num_blocks // 100
        self.seqs: dict[int, Seq] = {}
        self._decoding: list[Seq] = []
        self._prefilling: list[Seq] = []  # FIFO; preempted sequences go back to its head
        self._next_seq_id = 0
        self.num_preemptions = 0
        #: Sequences preempted while the current step was planned: whatever was planned for them is void.
        self._preempted_in_plan: set[int] = set()

    @property
    def pool(self) -> BlockPool:
        return self.ledger.pool

    # -- admission ------------------------------------------------------------------------------------

    def can_admit(self, request: GenerationRequest) -> bool:
        """Room for the prompt's blocks (and a first generated token) beside what prefilling sequences are still
        to take, keeping a headroom for decoding ones."""
        if len(self.seqs) >= self.capacity:
            return False
        ledger = self.ledger
        promised = sum(ledger.blocks_for(s.target + 1) - len(s.blocks.blocks) for s in self._prefilling)
        needed = ledger.blocks_for(len(request.prompt_ids) + 1)
        return self.pool.num_available - promised - self._headroom >= needed

    def admit(self, requests: list[GenerationRequest]) -> list[Seq]:
        """Atomic: every request is checked before any is queued."""
        if len(self.seqs) + len(requests) > self.capacity:
            raise RuntimeError(f"admit of {len(requests)} would exceed capacity {self.capacity}")
        for request in requests:
            validate_request(request, self.max_model_len)
        seqs = []
        for offset, request in enumerate(requests):
            seq = Seq(self._next_seq_id + offset, request, self.ledger.open(), target=len(request.prompt_ids))
            if request.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]  # the first prompt token has nothing before it
                seq.matched = True  # every prompt row is scored: nothing from the prefix cache
            seqs.append(seq)
        self._next_seq_id += len(seqs)
        self.seqs.update((seq.seq_id, seq) for seq in seqs)
        self._prefilling.extend(seqs)
        return seqs

    def abort(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        self._unqueue(seq)
        self.ledger.close(seq.blocks)

    def reset(self) -> None:
        """Drop every sequence and the prefix cache."""
        self.seqs.clear()
        self._decoding.clear()
        self._prefilling.clear()
        self.ledger.reset()

    # -- planning -------------------------------------------------------------------------------------

    def plan(self) -> Plan:
        self._preempted_in_plan.clear()
        decoding = []
        for seq in list(self._decoding):  # oldest first: the newest are preempted first
            if seq.seq_id not in self._preempted_in_plan and self._grow(seq, 1):
                decoding.append(seq)
        planned = self._plan_prefill(max(self.max_num_batched_tokens - len(decoding), MIN_PREFILL_BUDGET))
        # A sequence planned and then preempted for a later one (a preempted sequence planned first, at the
        # head of the queue, is newer than those behind it) is back in the queue with no blocks: not this step.
        planned = [(seq, length) for seq, length in planned if seq.seq_id not in self._preempted_in_plan]
        decoding = [seq for seq in decoding if seq.seq_id not in self._preempted_in_plan]
        row = len(decoding)
        chunks: list[tuple[Seq, PrefillChunk]] = []
        for seq, length in planned:
            chunks.append((seq, PrefillChunk(row, seq.num_computed, length)))
            row += length
        completing = [(seq, chunk) for seq, chunk in chunks if chunk.start + chunk.length == seq.target]
        return Plan(decoding, chunks, completing)

    def _plan_prefill(self, budget: int) -> list[tuple[Seq, int]]:
        """Prefilling sequences in order, each with the positions it computes this step, within ``budget``."""
        planned: list[tuple[Seq, int]] = []
        for seq in list(self._prefilling):
            if budget <= 0:
                break
            if seq.seq_id in self._preempted_in_plan:
                continue  # preempted while this plan was made: back at the queue's head, for a later step
            length = self._prefill_length(seq, budget)
            if length == 0:
                break  # the pool is full: later ones wait too (FIFO)
            planned.append((seq, length))
            budget -= length
        return planned

    def _prefill_length(self, seq: Seq, budget: int) -> int:
        """How many of ``seq``'s positions to prefill this step, after taking its cached prefix on its first
        chunk and the blocks for them; as many as the pool has room for."""
        if not seq.matched:
            seq.matched = True
            held = self.ledger.take_prefix(seq.blocks, seq.tokens(seq.target), seq.target - 1, self._copy_block)
            seq.num_computed = held
            if not seq.output_ids:
                seq.cached_tokens = held
        length = min(seq.target - seq.num_computed, budget)
        if not self._grow(seq, length, preempt_self=False):
            length = len(seq.blocks.blocks) * self.ledger.block_size - seq.num_computed
        return max(length, 0)

    def _grow(self, seq: Seq, rows: int, preempt_self: bool = True) -> bool:
        """Give ``seq`` blocks for its next ``rows`` positions, preempting the most recently admitted sequences
        while the pool has none. When ``seq`` is itself the most recent, it is preempted (``preempt_self``) or
        left to wait with what it got; returns whether it has them all."""
        while not self.ledger.grow(seq.blocks, seq.num_computed + rows):
            holders = [other for other in self.seqs.values() if other.blocks.blocks and other is not seq]
            victim = max([*holders, seq], key=lambda s: s.seq_id)
            if victim is seq:
                if preempt_self:
                    self._preempt(seq)
                return False
            self._preempt(victim)
        return True

    def _preempt(self, seq: Seq) -> None:
        """Free ``seq``'s blocks and put it back at the head of the prefill queue, to recompute what it held."""
        self._unqueue(seq)
        self.ledger.clear(seq.blocks)
        seq.num_computed = 0
        seq.target = seq.prompt_len + len(seq.output_ids)
        seq.matched = seq.scores_prompt  # a prompt still to score is computed whole again
        if seq.scores_prompt:
            seq.prompt_logprobs = [None]
        self._prefilling.insert(0, seq)
        self.num_preemptions += 1
        self._preempted_in_plan.add(seq.seq_id)

    def _unqueue(self, seq: Seq) -> None:
        """Take ``seq`` out of whichever list it is in: decoding or prefilling."""
        (self._decoding if seq in self._decoding else self._prefilling).remove(seq)

    # -- commit ---------------------------------------------------------------------------------------

    def commit(self, plan: Plan, next_tokens: list[tuple[int, TokenLogprob | None]]) -> list[StepOutput]:
        """The step ran: its positions are computed, and ``next_tokens`` (one per ``plan.sampled``) are appended.
        Finished sequences leave, their blocks back in the pool."""
        ledger = self.ledger
        outputs: list[StepOutput] = []
        for seq, token in zip(plan.decoding, next_tokens, strict=False):
            seq.num_computed += 1
            ledger.commit_full(seq.blocks, seq.num_computed, seq.token_at)
            outputs.append(self._append(seq, token))
        for seq, chunk in plan.chunks:
            seq.num_computed += chunk.length
            ledger.commit_full(seq.blocks, seq.num_computed, seq.token_at)
        for (seq, _), token in zip(plan.completing, next_tokens[len(plan.decoding) :], strict=True):
            first = not seq.output_ids
            out = self._append(seq, token)
            if first:
                out.prompt_logprobs = seq.prompt_logprobs
                out.cached_tokens = seq.cached_tokens
            outputs.append(out)
            self._prefilling.remove(seq)
            self._decoding.append(seq)
        for out in outputs:
            if out.finish_reason is not None:
                seq = self.seqs.pop(out.seq_id)
                self._decoding.remove(seq)
                ledger.close(seq.blocks)
        return outputs

    def _append(self, seq: Seq, sampled: tuple[int, TokenLogprob | None]) -> StepOutput:
        token, logprob = sampled
        seq.output_ids.append(token)
        request = seq.request
        if request.constraint is not None:
            request.constraint.accept(token)
        reason = finish_reason(request, token, len(seq.output_ids), self.eos_token_ids)
        return StepOutput(seq.seq_id, [token], reason, None if logprob is None else [logprob])
