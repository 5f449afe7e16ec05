"""Block-based KV memory in HFEngine: prefix caching, admission by what is held, preemption and the pool's
accounting, each against `generate` (greedy float32) or against the same run with the prefix cache off."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import make_engine, prompt_ids, reference, run_queued, run_staggered
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.core.types import GenerationRequest, SamplingParams
from engine.runtime.batch_engine import HFEngine

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir), AutoModelForCausalLM.from_pretrained(tiny_llama_dir)


def bytes_for_blocks(model: PreTrainedModel, blocks: int) -> int:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4 * BLOCK * blocks


def assert_pool_settled(engine: HFEngine) -> None:
    stats = engine.memory_stats()
    assert stats.blocks_in_use == 0
    assert stats.blocks_cached + stats.blocks_free == stats.num_blocks


def run_one(engine: HFEngine, request: GenerationRequest) -> tuple[list[int], int | None]:
    """Run ``request`` alone to the end: its tokens and the cached prompt tokens it reported."""
    (seq_id,) = engine.admit([request])
    tokens: list[int] = []
    cached = None
    while engine.num_active():
        for out in engine.step():
            assert out.seq_id == seq_id
            tokens += out.token_ids
            cached = out.cached_tokens if out.cached_tokens is not None else cached
    return tokens, cached


def test_prompts_that_hit_the_cache_fully_partly_or_not_match_generate(tiny_pair) -> None:
    model, ref_model = tiny_pair
    engine = make_engine(model, frozenset({7}), max_num_batched_tokens=40)
    base = prompt_ids(1, 70)
    cases = [
        (base, 0),  # nothing cached yet
        (base, 69),  # the same prompt again: all but its last token (which yields the first new one)
        (base[:64], 63),  # a prompt that ends on a block boundary inside what is cached
        (base[:50] + prompt_ids(2, 30), 50),  # diverges inside a block: 3 blocks + 2 tokens copied from the 4th
        (prompt_ids(3, 40), 0),  # shares nothing
    ]
    for prompt, expected_cached in cases:
        request = GenerationRequest(prompt, 12, ignore_eos=True)
        tokens, cached = run_one(engine, request)
        assert cached == expected_cached, len(prompt)
        assert tokens == reference(ref_model, request), len(prompt)
    stats = engine.memory_stats()
    assert stats.prefix_hit_tokens == 69 + 63 + 50
    assert stats.prefix_queried_tokens == 70 + 70 + 64 + 80 + 40
    assert_pool_settled(engine)


def test_the_next_turn_reuses_the_previous_answer(tiny_pair) -> None:
    """Blocks of generated tokens are cached too: a follow-up that re-sends prompt + answer recomputes only
    what is new."""
    model, ref_model = tiny_pair
    engine = make_engine(model, frozenset({7}))
    first = GenerationRequest(prompt_ids(4, 20), 40, ignore_eos=True)
    answer, _ = run_one(engine, first)
    follow_up = GenerationRequest(first.prompt_ids + tuple(answer) + prompt_ids(5, 6), 8, ignore_eos=True)
    tokens, cached = run_one(engine, follow_up)
    # The answer's last token was never fed back, so its K/V is not there: the cache holds 20 + 39 positions,
    # of which the full blocks count.
    assert cached == (20 + 39) // BLOCK * BLOCK
    assert tokens == reference(ref_model, follow_up)


def test_sequences_sharing_a_prefix_decode_side_by_side(tiny_pair) -> None:
    """Two sequences holding the same cached blocks at once (reference counts, never written), staggered."""
    model, ref_model = tiny_pair
    engine = make_engine(model, frozenset({7}), max_num_batched_tokens=32)
    shared = prompt_ids(6, 48)
    arrivals = [
        (0, GenerationRequest(shared + prompt_ids(7, 5), 30, ignore_eos=True)),
        (6, GenerationRequest(shared + prompt_ids(8, 9), 20, ignore_eos=True)),
        (7, GenerationRequest(shared + prompt_ids(9, 2), 25, ignore_eos=True)),
        (9, GenerationRequest(shared, 10, ignore_eos=True)),
    ]
    got = run_staggered(engine, arrivals)
    for index, (_, request) in enumerate(arrivals):
        assert got[index] == reference(ref_model, request), index
    assert engine.memory_stats().prefix_hit_tokens >= 3 * 47
    assert_pool_settled(engine)


def test_admission_asks_for_the_prompt_not_for_max_tokens(tiny_pair) -> None:
    """With the pool holding 20 blocks, four requests that may each run to 250 tokens are admitted together
    (a reservation of prompt + max_tokens would admit one), and the prompt's blocks are what is asked."""
    model, _ = tiny_pair
    engine = make_engine(model, frozenset({7}), max_model_len=256, kv_cache_bytes=bytes_for_blocks(model, 20))
    long_budget = GenerationRequest(prompt_ids(1, 30), 220)
    for _ in range(4):
        assert engine.can_admit(long_budget)
        engine.admit([long_budget])
    # 4 x 2 blocks promised + a headroom of 1 leave 11: a prompt (and its first token) of 12 blocks waits.
    assert not engine.can_admit(GenerationRequest(prompt_ids(2, 176), 10))
    assert engine.can_admit(GenerationRequest(prompt_ids(2, 160), 10))


def test_a_preempted_sequence_resumes_its_stream_exactly(tiny_pair) -> None:
    """A pool too small for everyone: the most recently admitted sequences are preempted and recomputed, and
    every stream is still token-identical to `generate`: nothing repeated, nothing lost."""
    model, ref_model = tiny_pair
    engine = make_engine(
        model, frozenset({7}), max_model_len=128, kv_cache_bytes=bytes_for_blocks(model, 12), max_num_batched_tokens=64
    )
    arrivals = [(at, GenerationRequest(prompt_ids(10 + at, 20 + 3 * at), 60, ignore_eos=True)) for at in range(5)]
    got = run_staggered(engine, arrivals)
    assert engine.num_preemptions > 0
    for index, (_, request) in enumerate(arrivals):
        assert got[index] == reference(ref_model, request), index
    assert_pool_settled(engine)


def test_a_preempted_seeded_sequence_draws_what_it_draws_unpreempted(tiny_pair) -> None:
    """Sampled with a seed, a preempted sequence produces what it produces unpreempted."""
    model, _ = tiny_pair
    sampling = SamplingParams(temperature=1.0, seed=1234)
    request = GenerationRequest(prompt_ids(20, 40), 70, ignore_eos=True, sampling=sampling)
    alone = make_engine(model, frozenset({7}), max_model_len=128)
    (expected, _) = run_one(alone, request)
    tight = make_engine(model, frozenset({7}), max_model_len=128, kv_cache_bytes=bytes_for_blocks(model, 10))
    others = [(0, GenerationRequest(prompt_ids(21 + i, 30), 60, ignore_eos=True)) for i in range(2)]
    got = run_staggered(tight, [(0, request), *others])
    assert tight.num_preemptions > 0
    assert got[0] == expected


@pytest.mark.parametrize("room", ["slots", "blocks"])
def test_a_parked_sequence_resumes_its_stream_exactly(tiny_pair, room: str) -> None:
    """Low-priority sequences (a batch's lines) hold every slot, or the pool's blocks; an urgent request parks the
    newest (``make_room``), is admitted at once and finishes first; the parked one resumes, from the prefix cache,
    and every stream is token-identical to `generate`."""
    model, ref_model = tiny_pair
    limits = {"capacity": 2} if room == "slots" else {"capacity": 4, "kv_cache_bytes": bytes_for_blocks(model, 12)}
    engine = make_engine(model, frozenset({7}), max_model_len=128, **limits)
    low = [GenerationRequest(prompt_ids(30 + i, 60), 40, ignore_eos=True, priority=10) for i in range(2)]
    urgent = GenerationRequest(prompt_ids(40, 60), 12, ignore_eos=True)
    index = {engine.admit([request])[0]: i for i, request in enumerate(low)}
    produced: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished: list[int] = []
    for step in range(500):
        if step == 6:
            assert not engine.can_admit(urgent) and engine.make_room(urgent)
            index[engine.admit([urgent])[0]] = 2
        for out in engine.step():
            produced[index[out.seq_id]] += out.token_ids
            finished += [index[out.seq_id]] if out.finish_reason else []
        if not engine.num_active():
            break
    assert finished[0] == 2 and engine.num_preemptions >= 1
    assert engine.memory_stats().prefix_hit_tokens >= 48  # the parked one's full blocks, found again
    for i, request in enumerate([*low, urgent]):
        assert produced[i] == reference(ref_model, request), i
    assert_pool_settled(engine)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 60), st.integers(1, 20), st.integers(0, 6)), min_size=1, max_size=8
    )
)
# Found by this test: a preempted sequence, back at the head of the prefill queue and planned first, preempted
# again for an older one behind it, kept its planned chunk with no blocks (the step failed).
@example([(0, 1, 1, 0), (0, 1, 1, 0), (0, 1, 1, 0), (0, 2, 6, 0), (0, 18, 4, 0), (0, 18, 4, 0), (0, 19, 1, 1),
          (1, 19, 1, 0)])  # fmt: skip
def test_a_small_pool_never_serves_stale_kv(tiny_pair, requests: list[tuple[int, int, int, int]]) -> None:
    """Prompts built from a few shared stems, admitted at random steps into a pool that holds a few of them:
    blocks are cached, evicted and reused, sequences preempted; every output equals a run with the prefix
    cache off and a large pool, and the pool settles."""
    model, _ = tiny_pair
    arrivals = [
        (at, GenerationRequest(prompt_ids(stem, 40)[: 10 + length % 30] + prompt_ids(50 + length, length % 7), new))
        for stem, length, new, at in requests
    ]
    tight = make_engine(
        model, frozenset({7}), max_model_len=128, kv_cache_bytes=bytes_for_blocks(model, 10), max_num_batched_tokens=32
    )
    roomy = make_engine(model, frozenset({7}), max_model_len=128, prefix_caching=False, max_num_batched_tokens=32)
    assert run_staggered(tight, arrivals) == run_staggered(roomy, arrivals)
    assert_pool_settled(tight)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 60), st.integers(1, 20), st.integers(0, 6), st.integers(0, 2)),
        min_size=1,
        max_size=8,
    )
)
def test_priorities_parking_and_a_small_pool_never_change_a_stream(
    tiny_pair, requests: list[tuple[int, int, int, int, int]]
) -> None:
    """As above, each request of a random ``priority`` queued and admitted as the scheduler does, three slots:
    more urgent ones park less urgent ones, which resume; every output equals a roomy run's, the pool settles."""
    model, _ = tiny_pair
    arrivals = [
        (
            at,
            GenerationRequest(
                prompt_ids(stem, 40)[: 10 + length % 30] + prompt_ids(50 + length, length % 7), new, priority=priority
            ),
        )
        for stem, length, new, at, priority in requests
    ]
    tight = make_engine(model, frozenset({7}), capacity=3, max_model_len=128,
                        kv_cache_bytes=bytes_for_blocks(model, 10), max_num_batched_tokens=32)  # fmt: skip
    roomy = make_engine(model, frozenset({7}), max_model_len=128, prefix_caching=False, max_num_batched_tokens=32)
    assert run_queued(tight, arrivals) == run_staggered(roomy, arrivals)
    assert_pool_settled(tight)
    assert tight.num_active() == 0


def test_prompt_logprobs_score_every_prompt_token_past_the_cache(tiny_pair) -> None:
    model, _ = tiny_pair
    engine = make_engine(model, frozenset({7}))
    prompt = prompt_ids(30, 50)
    run_one(engine, GenerationRequest(prompt, 2))  # now cached
    (seq_id,) = engine.admit([GenerationRequest(prompt, 2, prompt_logprobs=1)])
    first = next(out for out in engine.step() if out.seq_id == seq_id)
    assert first.cached_tokens == 0
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 50
    assert all(entry is not None for entry in first.prompt_logprobs[1:])
    while engine.num_active():
        engine.step()


def test_accounting_after_aborts_failures_and_reset(tiny_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a burst of finished, aborted and failed requests no block is in use; after a failed step the reset
    leaves a consistent, empty pool."""
    model, _ = tiny_pair
    engine = make_engine(model, frozenset({7}), max_num_batched_tokens=32)
    ids = engine.admit([GenerationRequest(prompt_ids(40 + i, 20 + 9 * i), 30, ignore_eos=True) for i in range(6)])
    for _ in range(5):
        engine.step()
    engine.abort(ids[1])  # decoding
    engine.abort(ids[5])  # still prefilling
    assert engine.memory_stats().blocks_in_use > 0
    while engine.num_active():
        engine.step()
    assert_pool_settled(engine)
    engine.admit([GenerationRequest(prompt_ids(50, 40), 10)])
    engine.step()

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine._runner, "forward", broken)
    with pytest.raises(RuntimeError):
        engine.step()
    engine.reset()
    stats = engine.memory_stats()
    assert engine.num_active() == 0 and stats.blocks_free == stats.num_blocks


@pytest.mark.real_model
def test_real_model_streams_through_preemption_read_as_without_it(real_model) -> None:
    """The default model in float32 through the scheduler: six streams in a pool of 20 blocks, where they are
    preempted and resumed, stream the same text, token for token, as in a roomy pool."""
    from engine.core.scheduler import Scheduler
    from engine.core.streams import RequestStream
    from engine.core.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(real_model.tokenizer, real_model.eos_token_ids)
    texts = ["The history of", "My grandmother's recipe for", "Rivers of Europe:", "In the year 3000,",
             "Ten facts about owls:", "def quicksort(xs):"]  # fmt: skip
    requests = [GenerationRequest(tuple(tokenizer.encode(t)), 48, ignore_eos=True) for t in texts]
    config = real_model.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_block = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4 * BLOCK

    def stream_all(engine: HFEngine) -> list[tuple[str, int]]:
        async def run() -> list[tuple[str, int]]:
            scheduler = Scheduler(engine, tokenizer)
            await scheduler.start()
            try:
                streams = [scheduler.submit(request) for request in requests]

                async def collect(stream: RequestStream) -> tuple[str, int]:
                    deltas = [delta async for delta in stream.deltas()]
                    return "".join(d.text for d in deltas), sum(len(d.token_ids) for d in deltas)

                return await asyncio.gather(*(collect(s) for s in streams))
            finally:
                await scheduler.stop()

        return asyncio.run(run())

    eos = real_model.eos_token_ids
    tight = make_engine(real_model.model, eos, max_model_len=256, kv_cache_bytes=20 * per_block)
    preempted = stream_all(tight)
    assert tight.num_preemptions > 0
    roomy = make_engine(real_model.model, eos, max_model_len=256)
    assert preempted == stream_all(roomy)
    assert all(count == 48 for _, count in preempted)
