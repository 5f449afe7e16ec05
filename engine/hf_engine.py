"""The continuous batching engine over a HuggingFace causal LM. See kv_cache.py for the memory layout."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from engine.base import InferenceEngine, finish_reason, validate_request
from engine.kv_cache import PrefillChunk, SlotKVCache, StepBatch
from engine.model_runner import make_runner
from engine.sampler import Row, select_tokens, token_logprobs
from engine.types import GenerationRequest, StepOutput, TokenLogprob


@dataclass(slots=True, eq=False)
class _Seq:
    seq_id: int
    request: GenerationRequest
    output_ids: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    staging: torch.Tensor | None = None  # prompt KV while prefilling
    slot: int | None = None  # set once decoding
    generator: torch.Generator | None = None  # for a seeded request
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled chunk by chunk when asked for

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_cached(self) -> int:
        """Positions in the KV cache; the newest output token is not fed yet."""
        return self.prompt_len + len(self.output_ids) - 1

    @property
    def reserved(self) -> int:
        return self.prompt_len + self.request.max_new_tokens


@dataclass(slots=True)
class _Plan:
    """Who runs in one step: every decoding slot, then prompt chunks of prefilling sequences."""

    decoding: list[_Seq]
    chunks: list[tuple[_Seq, PrefillChunk]]
    #: Sequences whose prompt ends in this step, with their chunk: its last row yields their first token.
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
    ) -> None:
        config = model.config
        self._runner = make_runner(model, max_model_len)
        self._device = model.device
        self.eos_token_ids = eos_token_ids
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.cache = SlotKVCache(
            config.num_hidden_layers, num_kv_heads, head_dim, model.dtype, self._device, kv_cache_dtype
        )
        self.max_kv_tokens = kv_cache_bytes // self.cache.bytes_per_token
        if self.max_kv_tokens < max_model_len:
            raise ValueError(
                f"a KV cache of {kv_cache_bytes} bytes holds {self.max_kv_tokens} tokens, "
                f"fewer than one sequence of max_model_len={max_model_len}"
            )
        self._slot_ids = torch.arange(capacity, device=self._device)
        self._seqs: dict[int, _Seq] = {}
        self._decoding: list[_Seq] = []  # index == slot
        self._prefilling: list[_Seq] = []  # FIFO
        self._next_seq_id = 0
        self._plan_now: _Plan | None = None  # the step being run, for describe_step

    # -- the seam -------------------------------------------------------------------------------------

    def num_active(self) -> int:
        return len(self._seqs)

    def can_admit(self, request: GenerationRequest) -> bool:
        if len(self._seqs) >= self.capacity:
            return False
        # Slots all span the longest sequence, so the storage bound is slots x longest reservation.
        longest = max((seq.reserved for seq in self._seqs.values()), default=0)
        reserved = max(longest, len(request.prompt_ids) + request.max_new_tokens)
        return (len(self._seqs) + 1) * reserved <= self.max_kv_tokens

    def admit(self, requests: list[GenerationRequest]) -> list[int]:
        if len(self._seqs) + len(requests) > self.capacity:
            raise RuntimeError(f"admit of {len(requests)} would exceed capacity {self.capacity}")
        for request in requests:
            validate_request(request, self.max_model_len)
        seqs = [_Seq(self._next_seq_id + i, request) for i, request in enumerate(requests)]
        for seq in seqs:
            if seq.request.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]  # the first prompt token has nothing before it
            if seq.request.sampling.seed is not None:
                seq.generator = torch.Generator(self._device).manual_seed(seq.request.sampling.seed)
        self._next_seq_id += len(seqs)
        self._seqs.update((seq.seq_id, seq) for seq in seqs)
        self._prefilling.extend(seqs)
        return [seq.seq_id for seq in seqs]

    def step(self) -> list[StepOutput]:
        plan = self._plan_now = self._plan()
        if not plan.decoding and not plan.chunks:
            return []
        # A step may hold prompt chunks alone, none of them complete (a prompt longer than the step's budget
        # on an idle engine): then no row is sampled, and the step only fills KV.
        sampled = plan.decoding + [seq for seq, _ in plan.completing]  # in the order of the logits' rows
        scored = [(seq, chunk) for seq, chunk in plan.chunks if seq.prompt_logprobs is not None]
        logits = self._forward(plan, scored)
        next_tokens: list[tuple[int, TokenLogprob | None]] = []
        if sampled:
            tokens, logprobs = select_tokens(logits[: len(sampled)], [self._row(seq) for seq in sampled])
            next_tokens = list(zip(tokens.tolist(), logprobs, strict=True))
        self._score_prompts(scored, logits[len(sampled) :])
        return self._commit(plan, next_tokens)

    def describe_step(self) -> str:
        """What the last step held: its rows, each sequence's prompt, position and chunk, the budget, the
        dtype and the kernels; logged when a step fails."""
        plan = self._plan_now
        if plan is None:
            return "no step yet"
        decoding = [f"seq {s.seq_id}: prompt {s.prompt_len}, position {s.num_cached}" for s in plan.decoding]
        chunks = [
            f"seq {s.seq_id}: prompt {s.prompt_len}, rows {c.row}..{c.row + c.length - 1} = positions "
            f"{c.start}..{c.start + c.length - 1}{' (completes)' if c.start + c.length == s.prompt_len else ''}"
            for s, c in plan.chunks
        ]
        rows = len(plan.decoding) + sum(c.length for _, c in plan.chunks)
        attention = "int8" if self.cache.quantized else "native" if self.cache.native_attention else "torch"
        return (
            f"{rows} rows ({len(plan.decoding)} decoding, {len(plan.chunks)} prompt chunks); step budget "
            f"{self.max_num_batched_tokens} tokens; {self.cache.dtype}, {attention} attention, "
            f"{type(self._runner).__name__}; decoding [{'; '.join(decoding)}]; chunks [{'; '.join(chunks)}]"
        )

    def abort(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if seq.slot is None:
            self._prefilling.remove(seq)
        else:
            self._free_slot(seq.slot)

    def reset(self) -> None:
        self._seqs.clear()
        self._decoding.clear()
        self._prefilling.clear()
        self.cache.release()

    # -- one step -------------------------------------------------------------------------------------

    def _plan(self) -> _Plan:
        # Decode rows count against the step's token budget; prefill gets the rest, but always some, so a
        # full batch of decodes cannot starve newcomers.
        budget = max(self.max_num_batched_tokens - len(self._decoding), 16)
        row = len(self._decoding)
        chunks: list[tuple[_Seq, PrefillChunk]] = []
        for seq in self._prefilling:
            if budget <= 0:
                break
            length = min(seq.prompt_len - seq.num_prefilled, budget)
            if seq.staging is None:
                seq.staging = self.cache.new_staging(seq.prompt_len)
            chunks.append((seq, PrefillChunk(row, seq.num_prefilled, length, seq.staging)))
            row += length
            budget -= length
        completing = [(seq, chunk) for seq, chunk in chunks if chunk.start + chunk.length == seq.prompt_len]
        return _Plan(list(self._decoding), chunks, completing)

    def _forward(self, plan: _Plan, scored: list[tuple[_Seq, PrefillChunk]]) -> torch.Tensor:
        """Run the packed forward; return logits for the rows that yield a token (decode rows first), then
        for every row of the ``scored`` chunks (prompts whose logprobs were asked for)."""
        longest = max(
            [seq.num_cached + 1 for seq in plan.decoding] + [seq.prompt_len for seq, _ in plan.completing], default=0
        )
        slots = len(plan.decoding) + len(plan.completing)
        self.cache.reserve(
            slots, longest, self.capacity, self.max_model_len, self.max_kv_tokens, live_slots=len(self._decoding)
        )
        token_ids = [seq.output_ids[-1] for seq in plan.decoding]
        positions = [seq.num_cached for seq in plan.decoding]
        for seq, chunk in plan.chunks:
            token_ids.extend(seq.request.prompt_ids[chunk.start : chunk.start + chunk.length])
            positions.extend(range(chunk.start, chunk.start + chunk.length))
        batch = self._step_batch(positions[: len(plan.decoding)], [chunk for _, chunk in plan.chunks])
        rows = None
        if plan.chunks:
            rows = list(range(len(plan.decoding)))
            rows += [chunk.row + chunk.length - 1 for _, chunk in plan.completing]
            rows += [row for _, chunk in scored for row in range(chunk.row, chunk.row + chunk.length)]
        with torch.inference_mode():
            return self._runner.forward(
                torch.tensor(token_ids, dtype=torch.long, device=self._device),
                torch.tensor(positions, dtype=torch.long, device=self._device),
                batch,
                None if rows is None else torch.tensor(rows, dtype=torch.long, device=self._device),
            )

    def _step_batch(self, decode_positions: list[int], chunks: list[PrefillChunk]) -> StepBatch:
        n = len(decode_positions)
        positions = torch.tensor(decode_positions, device=self._device)
        decode_len = max(decode_positions, default=-1) + 1
        mask = None
        # Rows of different lengths need a mask in torch's attention; the native kernel takes the lengths.
        if n and not self.cache.native_decode and min(decode_positions) != decode_len - 1:
            mask = torch.arange(decode_len, device=self._device)[None, :] <= positions[:, None]
            mask = mask[:, None, None, :]
        return StepBatch(self.cache, n, self._slot_ids[:n], positions, decode_len, positions + 1, mask, chunks)

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
        finished_slots: list[int] = []
        for seq, token in zip(plan.decoding, next_tokens, strict=False):
            out = self._append(seq, token)
            outputs.append(out)
            if out.finish_reason is not None:
                assert seq.slot is not None
                finished_slots.append(seq.slot)
        for slot in sorted(finished_slots, reverse=True):
            self._free_slot(slot)
        for seq, chunk in plan.chunks:
            seq.num_prefilled += chunk.length
        for (seq, _), token in zip(plan.completing, next_tokens[len(plan.decoding) :], strict=True):
            out = self._append(seq, token)
            out.prompt_logprobs = seq.prompt_logprobs
            outputs.append(out)
            self._prefilling.remove(seq)
            if out.finish_reason is None:
                self._start_decoding(seq)
        for out in outputs:
            if out.finish_reason is not None:
                del self._seqs[out.seq_id]
        return outputs

    def _append(self, seq: _Seq, sampled: tuple[int, TokenLogprob | None]) -> StepOutput:
        token, logprob = sampled
        seq.output_ids.append(token)
        request = seq.request
        if request.constraint is not None:
            request.constraint.accept(token)
        return StepOutput(seq.seq_id, [token], finish_reason(request, token, len(seq.output_ids), self.eos_token_ids),
                          None if logprob is None else [logprob])  # fmt: skip

    # -- slots ----------------------------------------------------------------------------------------

    def _start_decoding(self, seq: _Seq) -> None:
        assert seq.staging is not None
        seq.slot = len(self._decoding)
        self.cache.insert(seq.slot, seq.staging)
        seq.staging = None
        self._decoding.append(seq)

    def _free_slot(self, slot: int) -> None:
        """Fill the hole with the last slot so decoding sequences stay packed in slots 0..n-1."""
        last = self._decoding.pop()
        if last.slot != slot:
            self.cache.move(len(self._decoding), slot, last.num_cached)
            last.slot = slot
            self._decoding[slot] = last

    def release_idle_memory(self) -> None:
        """Free the KV storage if no sequence holds any. Kept while sequences come and go, because fresh
        memory is slow to come by: with the model loaded, faulting in a 377 MB cache took 0.15-1.8 s here,
        paid again by the first burst after every pause."""
        if not self._decoding:
            self.cache.release()
