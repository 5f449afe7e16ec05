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
token repeated or lost. Its sampling state goes on too (grammar, penalties; a seeded row's randomness is keyed by
the token's index).

Priority. A request of a lower ``priority`` value (an interactive one beside a batch's lines) that finds no slot
or no blocks parks resident sequences of a higher value, the least urgent and newest first (``make_room``): a parked
sequence gives back its slot and its blocks (full ones stay in the prefix cache) and, once there is room again,
resumes as a preempted one does, before any newcomer of its priority or a higher value. KV preemption picks its
victims the same way.

Speculation (``--speculative``, ``engine/core/drafter.py``). A decoding sequence may carry a draft: tokens its
text suggests will follow. It then runs as a verification chunk: its pending token and the draft, ``1 + k`` rows
at consecutive positions, every row's logits kept. The runtime accepts the longest prefix of the draft the model
agrees with, plus the model's own next token (``commit`` takes them all); the positions of rejected tokens are
rolled back: the sequence's computed length stops at what was accepted, blocks past it go back to the pool, and
only accepted tokens are ever hashed into the prefix cache. A draft never preempts anything: it is cut to the
blocks the pool can give. Rows with a grammar, and sequences before ``min_tokens`` or with prompt logprobs still
to score, get no drafts.

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

from engine.core.block_pool import BlockPool
from engine.core.blocks import BlockLedger, SeqBlocks
from engine.core.drafter import POPULATION_DECAY, DraftLength, DraftRecord, NgramDrafter
from engine.core.seam import finish_reason, validate_request
from engine.core.speculation import DraftBudget
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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled chunk by chunk when asked for
    #: This step's draft (speculative decoding): tokens to verify after its pending one.
    draft: list[int] = field(default_factory=list)
    drafter: NgramDrafter = field(default_factory=NgramDrafter)
    draft_length: DraftLength = field(default_factory=DraftLength)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    def token_at(self, position: int) -> int:
        prompt = self.request.prompt_ids
        return prompt[position] if position < len(prompt) else self.output_ids[position - len(prompt)]

    def tokens(self, end: int) -> list[int]:
        return [*self.request.prompt_ids, *self.output_ids][:end]

    def row_token(self, position: int) -> int:
        """The token a row at ``position`` reads: its own, or past them (a verification chunk) its draft's."""
        known = self.prompt_len + len(self.output_ids)
        return self.token_at(position) if position < known else self.draft[position - known]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt rows are scored: prompt logprobs were asked for and its first token is not out yet."""
        return self.prompt_logprobs is not None and not self.output_ids


def _urgency(seq: Seq) -> tuple[int, int]:
    """Most urgent first: lower ``priority`` values, then earlier admissions (the last is preempted or parked first)."""
    return seq.request.priority, seq.seq_id


@dataclass(slots=True)
class Plan:
    """Who runs in one step: decoding sequences (one row each), verification chunks of decoding sequences with a
    draft, then chunks of prefilling ones."""

    decoding: list[Seq]
    chunks: list[tuple[Seq, PrefillChunk]]
    #: Sequences whose prefill ends in this step, with their chunk: its last row yields their next token.
    completing: list[tuple[Seq, PrefillChunk]]
    #: Decoding sequences with a draft: their pending token and their draft, every row's logits kept.
    verifying: list[tuple[Seq, PrefillChunk]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decoding and not self.chunks and not self.verifying

    @property
    def sampled(self) -> list[Seq]:
        """The sequences that get tokens this step, in the order of the logits' rows (a verifying one has a row
        per token of its chunk: ``sampled_rows``)."""
        return self.decoding + [seq for seq, _ in self.verifying] + [seq for seq, _ in self.completing]

    @property
    def sampled_rows(self) -> list[int]:
        """The logits' rows of each of ``sampled``."""
        return [1] * len(self.decoding) + [c.length for _, c in self.verifying] + [1] * len(self.completing)

    @property
    def all_chunks(self) -> list[tuple[Seq, PrefillChunk]]:
        """Every chunk in row order: verification chunks, then prompt chunks."""
        return self.verifying + self.chunks

    @property
    def num_rows(self) -> int:
        return len(self.decoding) + sum(chunk.length for _, chunk in self.all_chunks)

    @property
    def num_drafted(self) -> int:
        return sum(len(seq.draft) for seq, _ in self.verifying)

    def describe(self) -> str:
        decoding = [f"seq {s.seq_id}: prompt {s.prompt_len}, position {s.num_computed}" for s in self.decoding]
        decoding += [f"seq {s.seq_id}: position {s.num_computed}, draft of {len(s.draft)}" for s, _ in self.verifying]
        chunks = [
            f"seq {s.seq_id}: prompt {s.prompt_len}, rows {c.row}..{c.row + c.length - 1} = positions "
            f"{c.start}..{c.start + c.length - 1}{' (completes)' if c.start + c.length == s.target else ''}"
            for s, c in self.chunks
        ]
        return (
            f"{self.num_rows} rows ({len(self.decoding) + len(self.verifying)} decoding, "
            f"{f'{self.num_drafted} drafted, ' if self.verifying else ''}{len(self.chunks)} prompt chunks); "
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
        draft_rows: DraftBudget | None = None,
        vocab_size: int | None = None,
        resume_state: Callable[[int, bytes], bool] | None = None,
    ) -> None:
        """``copy_block(src, dst)`` copies one block's K/V, for a cached prefix shared only in part.
        ``resume_state(row, hash)``: a hybrid model's recurrent state at a cached block's end into a sequence's row,
        if kept (``BlockLedger.take_prefix``).
        ``draft_rows``: how many tokens each decoding sequence drafts (speculative decoding,
        ``engine/core/speculation.py``; None: none). ``vocab_size``: the model's embedding rows, which every
        prompt token id must be below."""
        self.vocab_size = vocab_size
        self.ledger = ledger
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self._copy_block = copy_block
        self._resume_state = resume_state
        self.draft_rows = draft_rows
        #: Every sequence's drafts, recent ones weighing most: a new sequence's prior acceptance rates.
        self.drafts_record = DraftRecord(POPULATION_DECAY)
        #: Tokens drafted and accepted, since the start (speculative decoding's counters).
        self.num_drafts = 0
        self.num_drafted = 0
        self.num_accepted = 0
        # Blocks kept free at admission, for the decoding sequences that will cross into a new block.
        self._headroom = 1 + ledger.pool.num_blocks // 100
        self.seqs: dict[int, Seq] = {}
        self._decoding: list[Seq] = []
        self._prefilling: list[Seq] = []  # FIFO; preempted sequences go back to its head
        self._parked: list[Seq] = []  # parked for more urgent requests: no slot, no blocks, not in a step
        self._next_seq_id = 0
        self.num_preemptions = 0
        #: Sequences preempted while the current step was planned: whatever was planned for them is void.
        self._preempted_in_plan: set[int] = set()

    @property
    def pool(self) -> BlockPool:
        return self.ledger.pool

    # -- admission ------------------------------------------------------------------------------------

    @property
    def num_resident(self) -> int:
        """Sequences holding a slot: every admitted one but the parked."""
        return len(self.seqs) - len(self._parked)

    def can_admit(self, request: GenerationRequest) -> bool:
        """A slot, and room for the prompt's blocks (and a first generated token) beside what prefilling
        sequences are still to take, keeping a headroom for decoding ones; no parked sequence as urgent waits."""
        return not self._parked_ahead(request.priority) and self._fits(len(request.prompt_ids))

    def make_room(self, request: GenerationRequest) -> bool:
        """``can_admit``, after parking resident sequences of a higher ``priority`` value (the least urgent and
        newest first) while the request does not fit; none is parked where parking them all would not do."""
        if self._parked_ahead(request.priority):
            return False
        if self._fits(len(request.prompt_ids)):
            return True
        victims = sorted((s for s in self.seqs.values() if s.request.priority > request.priority and s not in
                          self._parked), key=_urgency)  # fmt: skip
        if not victims or not self._fits(len(request.prompt_ids), victims):
            return False
        while victims and not self._fits(len(request.prompt_ids)):
            self._park(victims.pop())
        return self._fits(len(request.prompt_ids))

    def _parked_ahead(self, priority: int) -> bool:
        return any(seq.request.priority <= priority for seq in self._parked)

    def _fits(self, positions: int, parking: list[Seq] | None = None) -> bool:
        """A slot and the blocks for ``positions`` (and a first generated token) beside what prefilling sequences
        are still to take and the headroom, once ``parking`` (resident sequences) gave back theirs."""
        parking = parking or []
        if self.num_resident - len(parking) >= self.capacity:
            return False
        ledger, pool = self.ledger, self.pool
        promised = sum(ledger.blocks_for(s.target + 1) - len(s.blocks.blocks) for s in self._prefilling
                       if s not in parking)  # fmt: skip
        freed = sum(1 for s in parking for block in s.blocks.blocks if pool.refs(block) == 1)
        return pool.num_available + freed - promised - self._headroom >= ledger.blocks_for(positions + 1)

    def _park(self, seq: Seq) -> None:
        """``seq`` leaves its slot and its blocks (full ones stay cached) until there is room again."""
        self._unqueue(seq)
        self.ledger.close(seq.blocks)
        self._forget_computed(seq)
        self._parked.append(seq)
        self.num_preemptions += 1

    def _resume_parked(self) -> None:
        """Parked sequences back in the prefill queue, the most urgent and oldest first, while each has a slot
        and room for what it recomputes."""
        self._parked.sort(key=_urgency)
        while self._parked and self._fits(self._parked[0].target):
            seq = self._parked.pop(0)
            seq.blocks = self.ledger.open()
            self._prefilling.append(seq)

    def admit(self, requests: list[GenerationRequest]) -> list[Seq]:
        """Atomic: every request is checked before any is queued."""
        if self.num_resident + len(requests) > self.capacity:
            raise RuntimeError(f"admit of {len(requests)} would exceed capacity {self.capacity}")
        for request in requests:
            validate_request(request, self.max_model_len, self.vocab_size)
        seqs = []
        for offset, request in enumerate(requests):
            seq = Seq(self._next_seq_id + offset, request, self.ledger.open(), target=len(request.prompt_ids))
            seq.draft_length.population = self.drafts_record
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
        if seq in self._parked:  # its slot and blocks are given back already
            self._parked.remove(seq)
            return
        self._unqueue(seq)
        self.ledger.close(seq.blocks)

    def reset(self) -> None:
        """Drop every sequence and the prefix cache."""
        self.seqs.clear()
        self._decoding.clear()
        self._prefilling.clear()
        self._parked.clear()
        self.ledger.reset()

    # -- planning -------------------------------------------------------------------------------------

    def plan(self) -> Plan:
        self._preempted_in_plan.clear()
        self._resume_parked()
        decoding = []
        for seq in list(self._decoding):  # oldest first: the newest are preempted first
            if seq.seq_id not in self._preempted_in_plan and self._grow(seq, 1):
                decoding.append(seq)
        planned = self._plan_prefill(max(self.max_num_batched_tokens - len(decoding), MIN_PREFILL_BUDGET))
        # A sequence planned and then preempted for a later one (a preempted sequence planned first, at the
        # head of the queue, is newer than those behind it) is back in the queue with no blocks: not this step.
        planned = [(seq, length) for seq, length in planned if seq.seq_id not in self._preempted_in_plan]
        decoding = [seq for seq in decoding if seq.seq_id not in self._preempted_in_plan]
        self._draft(decoding)
        drafted = [seq for seq in decoding if seq.draft]
        decoding = [seq for seq in decoding if not seq.draft]
        row = len(decoding)
        verifying: list[tuple[Seq, PrefillChunk]] = []
        for seq in drafted:
            verifying.append((seq, PrefillChunk(row, seq.num_computed, 1 + len(seq.draft))))
            row += 1 + len(seq.draft)
        chunks: list[tuple[Seq, PrefillChunk]] = []
        for seq, length in planned:
            chunks.append((seq, PrefillChunk(row, seq.num_computed, length)))
            row += length
        completing = [(seq, chunk) for seq, chunk in chunks if chunk.start + chunk.length == seq.target]
        return Plan(decoding, chunks, completing, verifying)

    def _draft(self, decoding: list[Seq]) -> None:
        """Each decoding sequence's draft for this step: what its text proposes, as long as its draft length, the
        positions ``max_model_len`` and ``max_tokens`` leave, and the step's budget allow
        (``DraftBudget.allocate``); cut to the blocks the pool gives without preempting anyone."""
        proposals: list[tuple[Seq, list[int]]] = []
        for seq in decoding:
            seq.draft = []
            request = seq.request
            if self.draft_rows is None or request.constraint is not None or len(seq.output_ids) < request.min_tokens:
                continue
            room = min(request.max_new_tokens - len(seq.output_ids), self.max_model_len - seq.num_computed) - 1
            want = min(seq.draft_length.next(), room)
            proposal = seq.drafter.propose(seq.tokens(seq.prompt_len + len(seq.output_ids)), want)
            if proposal:
                proposals.append((seq, proposal))
        if not proposals:
            return
        assert self.draft_rows is not None
        offers = [(len(proposal), *seq.draft_length.rates) for seq, proposal in proposals]
        for (seq, proposal), length in zip(proposals, self.draft_rows.allocate(len(decoding), offers), strict=True):
            if length:
                self.ledger.grow(seq.blocks, seq.num_computed + 1 + length)  # as far as the pool goes
                held = len(seq.blocks.blocks) * self.ledger.block_size - seq.num_computed - 1
                seq.draft = proposal[: min(length, held)]

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
            held = self.ledger.take_prefix(
                seq.blocks, seq.tokens(seq.target), seq.target - 1, self._copy_block, self._resume_state
            )
            seq.num_computed = held
            if not seq.output_ids:
                seq.cached_tokens = held
        length = min(seq.target - seq.num_computed, budget)
        if not self._grow(seq, length, preempt_self=False):
            length = len(seq.blocks.blocks) * self.ledger.block_size - seq.num_computed
        return max(length, 0)

    def _grow(self, seq: Seq, rows: int, preempt_self: bool = True) -> bool:
        """Give ``seq`` blocks for its next ``rows`` positions, preempting the least urgent (highest ``priority``
        value), most recently admitted sequences while the pool has none. When ``seq`` is itself that one, it is
        preempted (``preempt_self``) or left to wait with what it got; returns whether it has them all."""
        while not self.ledger.grow(seq.blocks, seq.num_computed + rows):
            holders = [other for other in self.seqs.values() if other.blocks.blocks and other is not seq]
            victim = max([*holders, seq], key=_urgency)
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
        self._forget_computed(seq)
        self._prefilling.insert(0, seq)
        self.num_preemptions += 1
        self._preempted_in_plan.add(seq.seq_id)

    @staticmethod
    def _forget_computed(seq: Seq) -> None:
        """``seq`` holds no K/V now: it recomputes its prompt and its output (from the prefix cache where it can)."""
        seq.num_computed = 0
        seq.target = seq.prompt_len + len(seq.output_ids)
        seq.matched = seq.scores_prompt  # a prompt still to score is computed whole again
        if seq.scores_prompt:
            seq.prompt_logprobs = [None]

    def _unqueue(self, seq: Seq) -> None:
        """Take ``seq`` out of whichever list it is in: decoding or prefilling."""
        (self._decoding if seq in self._decoding else self._prefilling).remove(seq)

    # -- commit ---------------------------------------------------------------------------------------

    def commit(self, plan: Plan, next_tokens: list[list[tuple[int, TokenLogprob | None]]]) -> list[StepOutput]:
        """The step ran: its positions are computed, and ``next_tokens`` (for each of ``plan.sampled``: one
        token, or a verifying sequence's accepted draft tokens and the model's next) are appended. Finished
        sequences leave, their blocks back in the pool."""
        ledger = self.ledger
        outputs: list[StepOutput] = []
        decoding = plan.decoding + [seq for seq, _ in plan.verifying]
        for seq, tokens in zip(decoding, next_tokens, strict=False):
            outputs.append(self._decoded(seq, tokens))
        for seq, chunk in plan.chunks:
            seq.num_computed += chunk.length
            ledger.commit_full(seq.blocks, seq.num_computed, seq.token_at)
        for (seq, _), tokens in zip(plan.completing, next_tokens[len(decoding) :], strict=True):
            first = not seq.output_ids
            out = self._append(seq, tokens[0])
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

    def _decoded(self, seq: Seq, tokens: list[tuple[int, TokenLogprob | None]]) -> StepOutput:
        """A decoding sequence's step: its pending token and the accepted part of its draft are computed now (the
        rest of its draft's positions are rolled back); ``tokens`` are appended up to the first that ends it."""
        drafted, accepted = len(seq.draft), len(tokens) - 1
        if drafted:
            seq.draft_length.record(drafted, accepted)
            self.num_drafts += 1
            self.num_drafted += drafted
            self.num_accepted += accepted
        seq.draft = []
        out = self._append(seq, tokens[0])
        for token in tokens[1:]:
            if out.finish_reason is not None:
                break
            more = self._append(seq, token)
            out.token_ids += more.token_ids
            out.logprobs = None if out.logprobs is None or more.logprobs is None else out.logprobs + more.logprobs
            out.finish_reason = more.finish_reason
        # Each token appended was computed from the one before it: the pending token, then accepted draft tokens.
        seq.num_computed += len(out.token_ids)
        self.ledger.commit_full(seq.blocks, seq.num_computed, seq.token_at)
        self.ledger.truncate(seq.blocks, seq.num_computed + 1)
        out.drafted, out.accepted = drafted, accepted
        return out

    def _append(self, seq: Seq, sampled: tuple[int, TokenLogprob | None]) -> StepOutput:
        token, logprob = sampled
        seq.output_ids.append(token)
        request = seq.request
        if request.constraint is not None:
            request.constraint.accept(token)
        reason = finish_reason(request, token, len(seq.output_ids), self.eos_token_ids)
        return StepOutput(seq.seq_id, [token], reason, None if logprob is None else [logprob])
