"""The continuous batching engine over a HuggingFace causal LM: it carries out the planner's steps.

The planner (``engine/core/planner.py``) decides who runs in a step, grants blocks, preempts, and commits the
step's tokens; here each plan is packed into one forward (decode rows first, then prompt chunks) over the block KV
cache (``engine/runtime/kv_cache.py``, tables in ``engine/runtime/block_tables.py``), its rows are sampled
(``engine/runtime/sampler.py``), and prompt rows are scored when prompt logprobs were asked for.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from engine.core.architectures import by_model_type, config_value
from engine.core.batch_mode import INVARIANT, BatchMode
from engine.core.block_pool import BlockPool
from engine.core.config import BLOCK_SIZE
from engine.core.planned_engine import PlannedEngine, StepTokens
from engine.core.planner import Plan, Planner, PrefillChunk, Seq
from engine.core.speculation import DraftBudget
from engine.core.thread_governor import ThreadGovernor
from engine.core.types import StepOutput
from engine.runtime import kernels
from engine.runtime.block_tables import BlockTables
from engine.runtime.kv_cache import BlockKVCache, StepBatch
from engine.runtime.kv_disk import DiskSpec, DiskTier, fingerprint
from engine.runtime.model_runner import LlamaRunner, make_runner
from engine.runtime.quantized_weights import SUPPORTED, QuantizedWeight
from engine.runtime.recurrent_state import RecurrentStates, Segment, StepStates
from engine.runtime.sampler import Row, token_logprobs
from engine.runtime.speculative import accept


def kv_cache_blocks(model: PreTrainedModel, kv_cache_bytes: int, kv_cache_dtype: str, block_size: int) -> int:
    """The blocks of ``block_size`` positions a KV cache of ``kv_cache_bytes`` holds for ``model``."""
    shape, layer_shapes = _cache_shape(model)
    per_block = BlockKVCache.bytes_per_token(*shape, kv_cache_dtype, layer_shapes) * block_size
    return kv_cache_bytes // per_block


def _cache_shape(
    model: PreTrainedModel,
) -> tuple[tuple[int, int, int, torch.dtype], list[tuple[int, int]] | None]:
    """The layers, KV heads, head size and dtype of ``model``'s KV cache (its attention layers only, less those that
    read another layer's KV: Gemma 4's last ones); and each such layer's KV heads and head size where they differ by
    layer (Gemma 4's global layers), else None."""
    config = model.config
    head_dim = config_value(config, "head_dim") or config.hidden_size // config.num_attention_heads
    num_kv_heads = config_value(config, "num_key_value_heads") or config.num_attention_heads
    recurrent, shared_from = set(_recurrent_layers(model)), config.num_hidden_layers - _shared_kv_layers(config)
    cached = [i for i in range(shared_from) if i not in recurrent]
    shape = len(cached), num_kv_heads, head_dim, model.dtype
    try:  # one shape for every layer, or (Gemma 4's) a config that refuses a global read of it
        getattr(config, "head_dim", None), getattr(config, "num_key_value_heads", None)
        return shape, None
    except RuntimeError:  # (transformers' AmbiguousGlobalPerLayerAttributeError)
        per_layer = config.per_layer_config
    shapes = [(per_layer[i].num_key_value_heads, per_layer[i].head_dim) for i in cached]
    return shape, (shapes if len(set(shapes)) > 1 else None)


def _shared_kv_layers(config: Any) -> int:
    """The last layers that read earlier layers' KV instead of their own (Gemma 4's; none in any other)."""
    return int(getattr(config, "num_kv_shared_layers", 0) or 0)


def _recurrent_layers(model: PreTrainedModel) -> list[int]:
    """The recurrent layers of a hybrid model (LFM2's short convolutions, Qwen3.5's linear attention), none in any
    other."""
    arch = by_model_type(model.config.model_type)
    if arch is None or not arch.recurrent:
        return []
    return [i for i, kind in enumerate(model.config.layer_types) if kind in ("conv", "linear_attention")]


def _state_shape(config: Any) -> tuple[int, int, tuple[int, int, int] | None]:
    """A hybrid's state per recurrent layer: its convolution's channels and span, and the delta rule's matrices
    (heads, key and value dims; None: no delta rule)."""
    if config.model_type == "lfm2":
        return config.hidden_size, config.conv_L_cache, None
    if config.model_type == "granitemoehybrid":  # Mamba-2: x, B, C convolved; a [state, head dim] matrix a head
        shared = config.mamba_n_groups * config.mamba_d_state
        channels = config.mamba_n_heads * config.mamba_d_head + 2 * shared
        return channels, config.mamba_d_conv, (config.mamba_n_heads, config.mamba_d_state, config.mamba_d_head)
    keys, values = config.linear_num_key_heads * config.linear_key_head_dim, config.linear_num_value_heads
    channels = 2 * keys + values * config.linear_value_head_dim
    matrix = (values, config.linear_key_head_dim, config.linear_value_head_dim)
    return channels, config.linear_conv_kernel_dim, matrix


def _recurrent_states(
    model: PreTrainedModel, capacity: int, block_size: int, kept_bytes: int
) -> RecurrentStates | None:
    """The recurrent states of a hybrid model's sequences, a slot for each of ``capacity``, and as many kept at
    cached blocks' ends as ``kept_bytes`` hold (None: no such layers)."""
    layers = _recurrent_layers(model)
    if not layers:
        return None
    channels, span, matrix = _state_shape(model.config)
    per_state = RecurrentStates.bytes_per_sequence(len(layers), channels, span, model.dtype, matrix)
    return RecurrentStates(len(layers), capacity, channels, span, model.dtype, model.device, block_size,
                           kept_bytes // per_state, matrix)  # fmt: skip


#: The shortest prefix whose state goes to the disk tier: a state is tens of megabytes (Granite 4.0-H-1B's 57 MB), a
#: file a prompt; a shorter prompt prefills again in about a second, and writing one for every short request took
#: bandwidth from decoding for little.
STATES_ON_DISK_FROM = 1024
#: The share of the KV cache's bytes that a hybrid's states kept at cached blocks' ends may take besides.
KEPT_STATES_SHARE = 8


class HFEngine(PlannedEngine):
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
        draft_rows: DraftBudget | None = None,
        kv_disk: DiskSpec | None = None,
        file_keys: dict[str, Any] | None = None,
    ) -> None:
        """``quantized``: weight matrices to multiply in their GGUF blocks (``engine/runtime/gguf_weights.py``);
        ``batch_mode``: one numeric path for every row count, or the fastest each step (``engine/core/batch_mode.py``);
        ``governor``: resizes the thread team between steps as other processes take or leave CPUs; ``draft_rows``:
        tokens each decoding sequence drafts (``engine/core/speculation.py``; None: none); ``kv_disk``: the prefix
        cache's disk tier (``kv_disk.py``; None: none); ``file_keys``: the GGUF's keys, for the model's description."""
        config = model.config
        self._runner = make_runner(model, max_model_len, quantized, batch_mode.invariant, batch_mode.dense_from_rows)
        self.batch_mode = batch_mode
        self.governor = governor
        self._device = model.device
        self.eos_token_ids = eos_token_ids
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        shape, layer_shapes = _cache_shape(model)
        num_blocks = kv_cache_blocks(model, kv_cache_bytes, kv_cache_dtype, block_size)
        if num_blocks * block_size < max_model_len + block_size:
            raise ValueError(
                f"a KV cache of {kv_cache_bytes} bytes holds {num_blocks * block_size} tokens, "
                f"too few for one sequence of max_model_len={max_model_len}"
            )
        self.cache = BlockKVCache(*shape, self._device, num_blocks, block_size, kv_cache_dtype, layer_shapes)
        draft_rows = self._recurrent(model, block_size, kv_cache_bytes if prefix_caching else 0, draft_rows)
        self.disk = self._disk_tier(kv_disk if prefix_caching else None, batch_mode, quantized)
        self.tables = BlockTables(
            BlockPool(num_blocks, block_size), capacity, max_model_len, self._device, prefix_caching, self.disk
        )
        self.planner = Planner(
            self.tables,
            capacity=capacity,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            eos_token_ids=eos_token_ids,
            copy_block=self.cache.copy_block,
            draft_rows=draft_rows,
            vocab_size=config.vocab_size,
            resume_state=self.states.resume if self.states is not None and prefix_caching else None,
        )
        self._facts = self._describe(quantized, model)
        self._facts["model"]["file_keys"] = dict(file_keys or {})

    def _recurrent(
        self, model: PreTrainedModel, block_size: int, kv_cache_bytes: int, draft_rows: DraftBudget | None
    ) -> DraftBudget | None:
        """A hybrid model's recurrent states (``kv_cache_bytes``: 0 without a prefix cache, else a share of it holds
        the states kept at cached blocks' ends), and the draft budget it allows: none (its state is not rolled
        back past a draft's rejected tokens)."""
        self.states = _recurrent_states(model, self.capacity, block_size, kv_cache_bytes // KEPT_STATES_SHARE)
        #: What a hybrid model turns off, and why.
        self.hybrid_limits: dict[str, str] = {}
        self._step_states: StepStates | None = None
        if self.states is None or draft_rows is None:
            return draft_rows
        each = self.states.block_bytes() / 2**10
        self.hybrid_limits["speculative"] = (
            "off: the recurrent layers' state is not rolled back past a draft (rolling back would keep the state at "
            f"every drafted position, {each:,.0f} KiB a sequence each, or compute the accepted tokens again)"
        )
        return None

    def _disk_tier(
        self, spec: DiskSpec | None, mode: BatchMode, quantized: dict[str, QuantizedWeight] | None
    ) -> DiskTier | None:
        """The prefix cache's disk tier, its files named by all that a block's bytes depend on; for a hybrid, its
        recurrent states' tier beside it (``states.disk``: the state at each prompt's last block end)."""
        if spec is None or spec.max_bytes <= 0:
            return None
        cache = self.cache
        identity = {
            **spec.identity, "dtype": str(cache.dtype), "int8": cache.quantized, "block_size": cache.block_size,
            "native_attention": cache.native_attention is not None, "invariant": mode.invariant,
            "dense_from_rows": mode.dense_from_rows, "blocks": sorted({w.qtype for w in (quantized or {}).values()}),
            "cpu": kernels.cpu_tag(),
        }  # fmt: skip
        if self.states is not None:
            self.states.disk = DiskTier(self.states, spec.directory, spec.max_bytes // KEPT_STATES_SHARE,
                                        fingerprint({**identity, "states": True}), timed=False)  # fmt: skip
        return DiskTier(cache, spec.directory, spec.max_bytes, fingerprint(identity), spec.prefill_seconds_per_token)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        if self.states is not None and self.states.disk is not None:
            self.states.disk.close()

    @property
    def pool(self) -> BlockPool:
        return self.tables.pool

    # -- the runner (plan -> run -> commit, admission, aborts: the core's, ``PlannedEngine``) -----------------

    def before_step(self) -> None:
        if self.governor is not None:
            self.governor.before_step()

    def run(self, plan: Plan) -> StepTokens:
        # A step may hold prompt chunks alone, none of them complete (a prompt longer than the step's budget
        # on an idle engine): then no row is sampled, and the step only fills KV.
        scored = [(seq, chunk) for seq, chunk in plan.chunks if seq.scores_prompt]
        logits = self._forward(plan, scored)
        num_sampled = sum(plan.sampled_rows)
        next_tokens = self._select(plan, logits[:num_sampled])
        self._score_prompts(scored, logits[num_sampled:])
        return next_tokens

    def committed(self, plan: Plan, outputs: list[StepOutput], seconds: float) -> None:
        self._keep_states(plan)
        if self.disk is not None and plan.chunks:  # a prefill's cost, against a read from disk
            self.disk.observe_prefill(plan.num_rows, seconds)
        if (drafts := self.planner.draft_rows) is not None and not plan.chunks:  # decoding rows only
            drafts.observe(plan.num_rows, seconds)
        if self.governor is not None:
            self.governor.after_step()

    def describe_step(self) -> str:
        """What the last step held: its rows, each sequence's prompt, position and chunk, the budget, the
        dtype, the kernels and the pool; logged when a step fails."""
        plan = self.plan_now
        if plan is None:
            return "no step yet"
        attention = "int8" if self.cache.quantized else "native" if self.cache.native_attention else "torch"
        pool = self.pool
        return (
            f"{plan.describe()}; step budget {self.max_num_batched_tokens} tokens; {self.cache.dtype}, {attention} "
            f"attention, {type(self._runner).__name__}; KV blocks {pool.num_in_use} in use, {pool.num_cached} "
            f"cached, {pool.num_free} free"
        )

    def reset(self) -> None:
        super().reset()
        if self.states is not None:
            self.states.forget()

    def _keep_states(self, plan: Plan) -> None:
        """A hybrid's states at the block ends the step reached, kept by the hashes the commit gave those blocks."""
        step, self._step_states = self._step_states, None
        if step is None or self.states is None:
            return
        seqs = [*plan.decoding, *(seq for seq, _ in plan.all_chunks)]  # in the step's segments' order
        size = self.states.block_size
        kept = zip(step.boundaries, step.states_at_boundaries(), step.matrices_at(), strict=True)
        for (index, end), state, matrix in kept:
            seq = seqs[index]
            if end // size <= len(seq.blocks.hashes):
                # (the state: a view of the step's stacked states, copied; the matrices: a buffer a boundary)
                last = index >= len(plan.decoding) and end == seq.target // size * size  # a prompt's last block end
                last = last and end >= STATES_ON_DISK_FROM
                self.states.keep(seq.blocks.hashes[end // size - 1], state.clone(), matrix, persist=last)
            else:
                self.states.recycle(matrix)
        if self.states.disk is not None:
            self.states.disk.end_step()

    def disk_stats(self) -> dict[str, Any] | None:
        if self.disk is None:
            return None
        described = self.disk.describe()
        if self.states is not None and self.states.disk is not None:
            described["states"] = self.states.disk.describe()  # a hybrid's: states written and restored
        return described

    def runtime_info(self) -> dict[str, Any]:
        mode = self.batch_mode
        info: dict[str, Any] = {
            "batch_invariant": mode.invariant,
            "batch_invariant_mode": mode.requested,
            "dense_from_rows": mode.dense_from_rows,
            "invariance_cost": None if mode.cost is None else round(mode.cost, 3),
            "speculative": "none" if (drafts := self.planner.draft_rows) is None else drafts.describe(),
        }
        if self.governor is not None:
            governor = self.governor
            info.update(threads=governor.threads, max_threads=governor.max_threads, threads_reason=governor.reason)
        if self.disk is not None:
            info["kv_disk"] = self.disk.describe()
        return {**info, **self._facts}

    def _describe(self, quantized: dict[str, QuantizedWeight] | None, model: PreTrainedModel) -> dict[str, Any]:
        """What this engine runs, for the start-up summary and ``/health``: its weights, KV pool and limits."""
        names = {code: name for name, code in SUPPORTED.items()}
        blocks = sorted({names[weight.qtype] for weight in (quantized or {}).values()})
        dtype = str(model.dtype).removeprefix("torch.")
        forward = "the native forward" if isinstance(self._runner, LlamaRunner) else "transformers' forward"
        arch = by_model_type(model.config.model_type)  # named as GGUF files name it (gemma3, not gemma3_text)
        kind = arch.gguf if arch is not None else model.config.model_type
        weights = f"{kind}, {forward}, dense {dtype}"
        if blocks:
            weights = f"{kind}, GGUF blocks {'/'.join(blocks)} (native kernels), activations {dtype}"
            if self._runner.dense_from_rows is not None:
                weights += f"; a dense {dtype} copy for steps from {self._runner.dense_from_rows} rows"
        cache, pool = self.cache, self.pool
        positions = pool.num_blocks * pool.block_size
        per_token = BlockKVCache.bytes_per_token(
            cache.num_layers,
            cache.num_kv_heads,
            cache.head_dim,
            cache.dtype,
            "int8" if cache.quantized else "auto",
            cache.layer_shapes,
        )
        return {
            "weights": weights,
            # What a model listing shows (Ollama's details): the architecture as its GGUF names it, the weights'
            # count and block types.
            "model": {"architecture": kind, "parameters": model.num_parameters(), "block_types": blocks},
            "kv_cache": {
                "blocks": pool.num_blocks, "block_size": pool.block_size, "tokens": positions,
                "bytes": positions * per_token, "dtype": "int8" if cache.quantized else dtype,
            },
            "max_batch_size": self.capacity, "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len, "prefix_caching": self.tables.caching,
            **self._describe_states(model.config.model_type),
        }  # fmt: skip

    def _describe_states(self, model_type: str) -> dict[str, Any]:
        """A hybrid model's recurrent states: what a sequence's costs beside its KV blocks, and what is off."""
        states = self.states
        if states is None:
            return {}
        per_sequence = RecurrentStates.bytes_per_sequence(
            states.layers, states.channels, states.span, states.dtype, states.matrix
        )
        kind = ("short convolution" if states.matrix is None
                else "Mamba-2 scan" if model_type == "granitemoehybrid" else "gated delta rule")  # fmt: skip
        return {
            "recurrent_state": {
                "layers": states.layers, "kind": kind, "bytes_per_sequence": per_sequence,
                "bytes": per_sequence * states.slots, "kept_at_block_ends": states.max_checkpoints,
                "kept_bytes": per_sequence * states.max_checkpoints,
            },
            "hybrid_limits": dict(self.hybrid_limits),
        }  # fmt: skip

    def release_idle_memory(self) -> None:
        """Hand the pool's pages back to the OS when no block holds anything: no sequence, and nothing in the
        prefix cache (which is kept across idle gaps: reusing it is its point)."""
        if not self.planner.seqs and self.pool.num_cached == 0:
            self.cache.release_memory()

    # -- one step -------------------------------------------------------------------------------------

    def _forward(self, plan: Plan, scored: list[tuple[Seq, PrefillChunk]]) -> torch.Tensor:
        """Run the packed forward; return logits for the rows that yield a token (decode rows first), then
        for every row of the ``scored`` chunks (prompts whose logprobs were asked for)."""
        token_ids = [seq.output_ids[-1] for seq in plan.decoding]
        positions = [seq.num_computed for seq in plan.decoding]
        table_rows = [seq.blocks.row for seq in plan.decoding]
        slots = [self.tables.slot(seq.blocks, seq.num_computed) for seq in plan.decoding]
        for seq, chunk in plan.all_chunks:
            end = chunk.start + chunk.length
            token_ids.extend(seq.row_token(p) for p in range(chunk.start, end))
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
            [chunk for _, chunk in plan.all_chunks],
        )
        if self.states is not None:
            batch.states = self._step_states = self.states.step(_segments(plan), len(token_ids))
        rows = None
        if plan.chunks:
            rows = list(range(len(plan.decoding)))
            rows += [row for _, chunk in plan.verifying for row in range(chunk.row, chunk.row + chunk.length)]
            rows += [chunk.row + chunk.length - 1 for _, chunk in plan.completing]
            rows += [row for _, chunk in scored for row in range(chunk.row, chunk.row + chunk.length)]
        with torch.inference_mode():
            return self._runner.forward(
                torch.tensor(token_ids, dtype=torch.long, device=device),
                position_tensor,
                batch,
                None if rows is None else torch.tensor(rows, dtype=torch.long, device=device),
            )

    def _select(self, plan: Plan, logits: torch.Tensor) -> StepTokens:
        """Each sampled sequence's tokens: one; or for a verifying one, its draft's accepted tokens and the
        model's next (``engine/runtime/speculative.py``)."""
        sampled, counts = plan.sampled, plan.sampled_rows
        rows = [self._row(seq, i) for seq, count in zip(sampled, counts, strict=True) for i in range(count)]
        return accept(logits, rows, [(seq.draft, count) for seq, count in zip(sampled, counts, strict=True)])

    def _score_prompts(self, scored: list[tuple[Seq, PrefillChunk]], logits: torch.Tensor) -> None:
        """Each prompt position's logits score the next prompt token."""
        offset = 0
        for seq, chunk in scored:
            assert seq.prompt_logprobs is not None
            positions = range(chunk.start, min(chunk.start + chunk.length, seq.prompt_len - 1))
            targets = torch.tensor([seq.request.prompt_ids[p + 1] for p in positions], device=logits.device)
            num_top = [seq.request.prompt_logprobs or 0] * len(positions)
            seq.prompt_logprobs += token_logprobs(logits[offset : offset + len(positions)], targets, num_top)
            offset += chunk.length

    def _row(self, seq: Seq, offset: int = 0) -> Row:
        """What the sampler needs for ``seq``'s row; ``offset`` > 0: the row after ``offset`` of its draft's tokens
        (a verification chunk's), as it would be were they generated."""
        request = seq.request
        output = seq.output_ids if not offset else [*seq.output_ids, *seq.draft[:offset]]
        banned: frozenset[int] = frozenset()
        if len(output) < request.min_tokens:
            banned = request.stop_token_ids | (frozenset() if request.ignore_eos else self.eos_token_ids)
        sampling = request.sampling
        return Row(sampling, sampling.seed, request.prompt_ids, output, banned, request.logprobs, request.constraint)


def _segments(plan: Plan) -> list[Segment]:
    """Each sequence's rows of a step, for its recurrent state: a decoding row, or a prompt chunk."""
    segments = [Segment(seq.blocks.row, seq.num_computed, row, 1) for row, seq in enumerate(plan.decoding)]
    return segments + [Segment(seq.blocks.row, chunk.start, chunk.row, chunk.length) for seq, chunk in plan.all_chunks]
