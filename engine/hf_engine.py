"""The continuous batching engine over a HuggingFace causal LM, on block-based KV memory.

Memory. Sequences hold blocks of a pool (``engine/block_pool.py``) through block tables
(``engine/block_tables.py``); the K/V tensors are ``engine/kv_cache.py``'s. A sequence takes blocks as it grows
and returns them when it leaves, so admission asks only for room for a newcomer's prompt (plus a small
headroom), not for everything it might generate.

Preemption. When a decoding sequence needs a block and the pool has none, the most recently admitted sequence
is preempted: its blocks are released (its full ones stay in the prefix cache) and it goes back to the head of
the prefill queue. Readmitted, it recomputes its prompt and the tokens it produced (from the prefix cache where
they are still there); the last row of that recompute yields its next token, and its stream goes on with no
token repeated or lost. Its sampling state (seeded generator, grammar, penalties) is its own and goes on too.

Prefix caching. A newcomer first takes the longest cached prefix of its prompt and prefills only the rest; at
least its last prompt token is always computed, for the logits of its first token. Requests for prompt logprobs
bypass the cache: every prompt row is computed and scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from engine.base import InferenceEngine, finish_reason, validate_request
from engine.batch_mode import INVARIANT, BatchMode
from engine.block_pool import BlockPool
from engine.block_tables import BlockTables, SeqBlocks
from engine.kv_cache import BLOCK_SIZE, BlockKVCache, PrefillChunk, StepBatch
from engine.model_runner import make_runner
from engine.quantized_weights import QuantizedWeight
from engine.sampler import Row, select_tokens, token_logprobs
from engine.thread_governor import ThreadGovernor
from engine.types import GenerationRequest, MemoryStats, StepOutput, TokenLogprob


@dataclass(slots=True, eq=False)
class _Seq:
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
    generator: torch.Generator | None = None  # for a seeded request
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
class _Plan:
    """Who runs in one step: every decoding sequence, then chunks of prefilling ones."""

    decoding: list[_Seq]
    chunks: list[tuple[_Seq, PrefillChunk]]
    #: Sequences whose prefill ends in this step, with their chunk: its last row yields their next token.
    completing: list[tuple[_Seq, PrefillChunk]]


class HFEngine(InferenceEngine):
    """Continuous batching: one packed forward per step over all decoding sequences and prefill chunks."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: frozenset[int],
        capacity: int,
        max_model_len: int,
        kv_cache_bytes: int,
        max_num_batched_tokens: int,
        kv_cache_dtype: str = "auto",
        block_size: int = BLOCK_SIZE,
        prefix_caching: bool = True,
        quantized: dict[str, QuantizedWeight] | None = None,
        batch_mode: BatchMode = INVARIANT,
        governor: ThreadGovernor | None = None,
    ) -> None:
        """``quantized``: weight matrices to multiply in their GGUF blocks (``engine/gguf_weights.py``);
        ``batch_mode``: one numeric path for every row count, or the fastest for each step
        (``engine/batch_mode.py``); ``governor``: resizes the thread team between steps as other processes take
        or leave CPUs."""
        config = model.config
        self._runner = make_runner(model, max_model_len, quantized, batch_mode.invariant, batch_mode.dense_from_rows)
        self.batch_mode = batch_mode
        self.governor = governor
        self._device = model.device
        self.eos_token_ids = eos_token_ids
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        shape = (config.num_hidden_layers, num_kv_heads, head_dim, model.dtype)
        per_block = BlockKVCache.bytes_per_token(*shape, kv_cache_dtype) * block_size
        num_blocks = kv_cache_bytes // per_block
        if num_blocks * block_size < max_model_len + block_size:
            raise ValueError(
                f"a KV cache of {kv_cache_bytes} bytes holds {num_blocks * block_size} tokens, "
                f"too few for one sequence of max_model_len={max_model_len}"
            )
        self.cache = BlockKVCache(*shape, self._device, num_blocks, block_size, kv_cache_dtype)
        self.tables = BlockTables(
            BlockPool(num_blocks, block_size), capacity, max_model_len, self._device, prefix_caching
        )
        # Blocks kept free at admission, for the decoding sequences that will cross into a new block.
        self._headroom = 1 + num_blocks // 100
        self._seqs: dict[int, _Seq] = {}
        self._decoding: list[_Seq] = []
        self._prefilling: list[_Seq] = []  # FIFO; preempted sequences go back to its head
        self._next_seq_id = 0
        self.num_preemptions = 0
        #: Sequences preempted while the current step was planned: whatever was planned for them is void.
        self._preempted_in_plan: set[int] = set()
        self._plan_now: _Plan | None = None  # the step being run, for describe_step

    @property
    def pool(self) -> BlockPool:
        return self.tables.pool

    # -- the seam -------------------------------------------------------------------------------------

    def num_active(self) -> int:
        return len(self._seqs)

    def can_admit(self, request: GenerationRequest) -> bool:
        """Room for the prompt's blocks (and a first generated token) beside what prefilling sequences are still
        to take, keeping a headroom for decoding ones."""
        if len(self._seqs) >= self.capacity:
            return False
        promised = sum(self.tables.blocks_for(s.target + 1) - len(s.blocks.blocks) for s in self._prefilling)
        needed = self.tables.blocks_for(len(request.prompt_ids) + 1)
        return self.pool.num_available - promised - self._headroom >= needed

    def admit(self, requests: list[GenerationRequest]) -> list[int]:
        if len(self._seqs) + len(requests) > self.capacity:
            raise RuntimeError(f"admit of {len(requests)} would exceed capacity {self.capacity}")
        for request in requests:
            validate_request(request, self.max_model_len)
        seqs = []
        for offset, request in enumerate(requests):
            seq = _Seq(self._next_seq_id + offset, request, self.tables.open(), target=len(request.prompt_ids))
            if request.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]  # the first prompt token has nothing before it
                seq.matched = True  # every prompt row is scored: nothing from the prefix cache
            if request.sampling.seed is not None:
                seq.generator = torch.Generator(self._device).manual_seed(request.sampling.seed)
            seqs.append(seq)
        self._next_seq_id += len(seqs)
        self._seqs.update((seq.seq_id, seq) for seq in seqs)
        self._prefilling.extend(seqs)
        return [seq.seq_id for seq in seqs]

    def step(self) -> list[StepOutput]:
        if self.governor is not None:
            self.governor.before_step()
        plan = self._plan_now = self._plan()
        if not plan.decoding and not plan.chunks:
            return []
        # A step may hold prompt chunks alone, none of them complete (a prompt longer than the step's budget
        # on an idle engine): then no row is sampled, and the step only fills KV.
        sampled = plan.decoding + [seq for seq, _ in plan.completing]  # in the order of the logits' rows
        scored = [(seq, chunk) for seq, chunk in plan.chunks if seq.scores_prompt]
        logits = self._forward(plan, scored)
        next_tokens: list[tuple[int, TokenLogprob | None]] = []
        if sampled:
            tokens, logprobs = select_tokens(logits[: len(sampled)], [self._row(seq) for seq in sampled])
            next_tokens = list(zip(tokens.tolist(), logprobs, strict=True))
        self._score_prompts(scored, logits[len(sampled) :])
        outputs = self._commit(plan, next_tokens)
        if self.governor is not None:
            self.governor.after_step()
        return outputs

    def describe_step(self) -> str:
        """What the last step held: its rows, each sequence's prompt, position and chunk, the budget, the
        dtype, the kernels and the pool; logged when a step fails."""
        plan = self._plan_now
        if plan is None:
            return "no step yet"
        decoding = [f"seq {s.seq_id}: prompt {s.prompt_len}, position {s.num_computed}" for s in plan.decoding]
        chunks = [
            f"seq {s.seq_id}: prompt {s.prompt_len}, rows {c.row}..{c.row + c.length - 1} = positions "
            f"{c.start}..{c.start + c.length - 1}{' (completes)' if c.start + c.length == s.target else ''}"
            for s, c in plan.chunks
        ]
        rows = len(plan.decoding) + sum(c.length for _, c in plan.chunks)
        attention = "int8" if self.cache.quantized else "native" if self.cache.native_attention else "torch"
        pool = self.pool
        return (
            f"{rows} rows ({len(plan.decoding)} decoding, {len(plan.chunks)} prompt chunks); step budget "
            f"{self.max_num_batched_tokens} tokens; {self.cache.dtype}, {attention} attention, "
            f"{type(self._runner).__name__}; KV blocks {pool.num_in_use} in use, {pool.num_cached} cached, "
            f"{pool.num_free} free; decoding [{'; '.join(decoding)}]; chunks [{'; '.join(chunks)}]"
        )

    def abort(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._unqueue(seq)
        self.tables.close(seq.blocks)

    def reset(self) -> None:
        """Drop every sequence and the prefix cache (a failed step may have left any block half-written)."""
        self._seqs.clear()
        self._decoding.clear()
        self._prefilling.clear()
        self.tables.reset()

    def memory_stats(self) -> MemoryStats:
        pool = self.pool
        return MemoryStats(
            pool.num_blocks, pool.num_in_use, pool.num_cached, pool.num_free, pool.queried_tokens, pool.hit_tokens,
            self.num_preemptions,
        )  # fmt: skip

    def runtime_info(self) -> dict[str, Any]:
        mode = self.batch_mode
        info: dict[str, Any] = {
            "batch_invariant": mode.invariant,
            "batch_invariant_mode": mode.requested,
            "dense_from_rows": mode.dense_from_rows,
            "invariance_cost": None if mode.cost is None else round(mode.cost, 3),
        }
        if self.governor is not None:
            governor = self.governor
            info.update(threads=governor.threads, max_threads=governor.max_threads, threads_reason=governor.reason)
        return info

    def release_idle_memory(self) -> None:
        """Hand the pool's pages back to the OS when no block holds anything: no sequence, and nothing in the
        prefix cache (which is kept across idle gaps: reusing it is its point)."""
        if not self._seqs and self.pool.num_cached == 0:
            self.cache.release_memory()

    # -- one step -------------------------------------------------------------------------------------

    def _plan(self) -> _Plan:
        self._preempted_in_plan.clear()
        decoding = []
        for seq in list(self._decoding):  # oldest first: the newest are preempted first
            if seq.seq_id not in self._preempted_in_plan and self._grow(seq, 1):
                decoding.append(seq)
        # Decode rows count against the step's token budget; prefill gets the rest, but always some, so a
        # full batch of decodes cannot starve newcomers.
        budget = max(self.max_num_batched_tokens - len(decoding), 16)
        planned: list[tuple[_Seq, int]] = []
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
        # A sequence planned and then preempted for a later one (a preempted sequence planned first, at the
        # head of the queue, is newer than those behind it) is back in the queue with no blocks: not this step.
        planned = [(seq, length) for seq, length in planned if seq.seq_id not in self._preempted_in_plan]
        decoding = [seq for seq in decoding if seq.seq_id not in self._preempted_in_plan]
        row = len(decoding)
        chunks: list[tuple[_Seq, PrefillChunk]] = []
        for seq, length in planned:
            chunks.append((seq, PrefillChunk(row, seq.num_computed, length)))
            row += length
        completing = [(seq, chunk) for seq, chunk in chunks if chunk.start + chunk.length == seq.target]
        return _Plan(decoding, chunks, completing)

    def _prefill_length(self, seq: _Seq, budget: int) -> int:
        """How many of ``seq``'s positions to prefill this step, after taking its cached prefix on its first
        chunk and the blocks for them; as many as the pool has room for."""
        if not seq.matched:
            seq.matched = True
            held = self.tables.take_prefix(seq.blocks, seq.tokens(seq.target), seq.target - 1, self.cache.copy_block)
            seq.num_computed = held
            if not seq.output_ids:
                seq.cached_tokens = held
        length = min(seq.target - seq.num_computed, budget)
        if not self._grow(seq, length, preempt_self=False):
            length = len(seq.blocks.blocks) * self.tables.block_size - seq.num_computed
        return max(length, 0)

    def _grow(self, seq: _Seq, rows: int, preempt_self: bool = True) -> bool:
        """Give ``seq`` blocks for its next ``rows`` positions, preempting the most recently admitted sequences
        while the pool has none. When ``seq`` is itself the most recent, it is preempted (``preempt_self``) or
        left to wait with what it got; returns whether it has them all."""
        while not self.tables.grow(seq.blocks, seq.num_computed + rows):
            holders = [other for other in self._seqs.values() if other.blocks.blocks and other is not seq]
            victim = max([*holders, seq], key=lambda s: s.seq_id)
            if victim is seq:
                if preempt_self:
                    self._preempt(seq)
                return False
            self._preempt(victim)
        return True

    def _preempt(self, seq: _Seq) -> None:
        """Free ``seq``'s blocks and put it back at the head of the prefill queue, to recompute what it held."""
        self._unqueue(seq)
        self.tables.clear(seq.blocks)
        seq.num_computed = 0
        seq.target = seq.prompt_len + len(seq.output_ids)
        seq.matched = seq.scores_prompt  # a prompt still to score is computed whole again
        if seq.scores_prompt:
            seq.prompt_logprobs = [None]
        self._prefilling.insert(0, seq)
        self.num_preemptions += 1
        self._preempted_in_plan.add(seq.seq_id)

    def _unqueue(self, seq: _Seq) -> None:
        """Take ``seq`` out of whichever list it is in: decoding or prefilling."""
        (self._decoding if seq in self._decoding else self._prefilling).remove(seq)

    def _forward(self, plan: _Plan, scored: list[tuple[_Seq, PrefillChunk]]) -> torch.Tensor:
        """Run the packed forward; return logits for the rows that yield a token (decode rows first), then
        for every row of the ``scored`` chunks (prompts whose logprobs were asked for)."""
        token_ids = [seq.output_ids[-1] for seq in plan.decoding]
        positions = [seq.num_computed for seq in plan.decoding]
        table_rows = [seq.blocks.row for seq in plan.decoding]
        slots = [self.tables.slot(seq.blocks, seq.num_computed) for seq in plan.decoding]
        for seq, chunk in plan.chunks:
            end = chunk.start + chunk.length
            token_ids.extend(seq.token_at(p) for p in range(chunk.start, end))
            positions.extend(range(chunk.start, end))
            table_rows.extend([seq.blocks.row] * chunk.length)
            slots.extend(self.tables.slots(seq.blocks, chunk.start, end))
        device = self._device
        position_tensor = torch.tensor(positions, dtype=torch.long, device=device)
        batch = StepBatch(
            self.cache,
            len(plan.decoding),
            torch.tensor(slots, dtype=torch.long, device=device),
            self.tables.rows(table_rows, max(positions) + 1),
            position_tensor + 1,
            [chunk for _, chunk in plan.chunks],
        )
        rows = None
        if plan.chunks:
            rows = list(range(len(plan.decoding)))
            rows += [chunk.row + chunk.length - 1 for _, chunk in plan.completing]
            rows += [row for _, chunk in scored for row in range(chunk.row, chunk.row + chunk.length)]
        with torch.inference_mode():
            return self._runner.forward(
                torch.tensor(token_ids, dtype=torch.long, device=device),
                position_tensor,
                batch,
                None if rows is None else torch.tensor(rows, dtype=torch.long, device=device),
            )

    def _score_prompts(self, scored: list[tuple[_Seq, PrefillChunk]], logits: torch.Tensor) -> None:
        """Each prompt position's logits score the next prompt token."""
        offset = 0
        for seq, chunk in scored:
            assert seq.prompt_logprobs is not None
            positions = range(chunk.start, min(chunk.start + chunk.length, seq.prompt_len - 1))
            targets = torch.tensor([seq.request.prompt_ids[p + 1] for p in positions], device=logits.device)
            num_top = [seq.request.prompt_logprobs or 0] * len(positions)
            seq.prompt_logprobs += token_logprobs(logits[offset : offset + len(positions)], targets, num_top)
            offset += chunk.length

    def _row(self, seq: _Seq) -> Row:
        request = seq.request
        banned: frozenset[int] = frozenset()
        if len(seq.output_ids) < request.min_tokens:
            banned = request.stop_token_ids | (frozenset() if request.ignore_eos else self.eos_token_ids)
        return Row(
            request.sampling, seq.generator, request.prompt_ids, seq.output_ids, banned, request.logprobs,
            request.constraint,
        )  # fmt: skip

    def _commit(self, plan: _Plan, next_tokens: list[tuple[int, TokenLogprob | None]]) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for seq, token in zip(plan.decoding, next_tokens, strict=False):
            seq.num_computed += 1
            self.tables.commit_full(seq.blocks, seq.num_computed, seq.token_at)
            outputs.append(self._append(seq, token))
        for seq, chunk in plan.chunks:
            seq.num_computed += chunk.length
            self.tables.commit_full(seq.blocks, seq.num_computed, seq.token_at)
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
                seq = self._seqs.pop(out.seq_id)
                self._decoding.remove(seq)
                self.tables.close(seq.blocks)
        return outputs

    def _append(self, seq: _Seq, sampled: tuple[int, TokenLogprob | None]) -> StepOutput:
        token, logprob = sampled
        seq.output_ids.append(token)
        request = seq.request
        if request.constraint is not None:
            request.constraint.accept(token)
        return StepOutput(seq.seq_id, [token], finish_reason(request, token, len(seq.output_ids), self.eos_token_ids),
                          None if logprob is None else [logprob])  # fmt: skip
